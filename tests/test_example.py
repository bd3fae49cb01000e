"""examples/existing_project: an ordinary Lightning project gains GRPO with its own Trainer, callbacks and logger."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "existing_project"


@pytest.mark.slow
def test_example_runs_sft_then_two_grpo_loop_steps(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))  # as `python examples/existing_project/grpo.py` would
    import grpo

    trainer = grpo.main(["--root", str(tmp_path), "--sft-steps", "2", "--loop-steps", "2", "--val-every", "2"])
    log_dir = Path(trainer.log_dir)
    assert log_dir == tmp_path / "grpo" / "version_0"  # the project's own CSVLogger
    with open(log_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [r for r in rows if r["reward/mean"]]
    assert [(r["step"], r["global_step"]) for r in steps] == [("1", "2.0"), ("2", "4.0")]  # n_mini = 2
    assert all("reward/exact_match" in r for r in steps)  # the project's reward, through compute_rewards
    assert [r["step"] for r in rows if r["val/reward"]] == ["2"]  # validation every 2 loop steps
    assert any(r.get("lr-AdamW") for r in rows)  # the project's LearningRateMonitor still runs
    assert (log_dir / "checkpoints" / "last.ckpt").is_file()  # and its ModelCheckpoint
    handoff = next(cb for cb in trainer.callbacks if isinstance(cb, grpo.HandoffCallback))
    assert handoff.events.count("train") == 2


def test_pytorch_lightning_trainer_rejects_a_grpo_module():
    """GRPOModule is a ``lightning.pytorch`` LightningModule; the ``pytorch_lightning`` package's Trainer refuses it."""
    pl = pytest.importorskip("pytorch_lightning")
    from helpers import SMALL

    from lightning_grpo import GRPOConfig, GRPOModule, PolicyConfig, PromptDataModule, RewardSpec

    module = GRPOModule(policy=PolicyConfig(path="tiny:namespace", tiny=SMALL),
                        rl=GRPOConfig(batch_per_replica=8, group_size=4), rewards=[RewardSpec("arith")])
    assert not isinstance(module, pl.LightningModule)
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(TypeError, match="`model` must be a `LightningModule`"):
        trainer.fit(module, datamodule=PromptDataModule(val_size=0))
