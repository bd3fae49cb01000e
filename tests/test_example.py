"""examples/existing_project: an ordinary Lightning project gains GRPO with its own Trainer, callbacks and logger."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch

from lightning_grpo.timing import is_timing

EXAMPLE = Path(__file__).parents[1] / "examples" / "existing_project"




@pytest.fixture(scope="module")
def grpo_example(tmp_path_factory):
    """``python examples/existing_project/grpo.py`` as a module (the script's folder on sys.path)."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        import grpo

        yield grpo
    finally:
        sys.path.remove(str(EXAMPLE))


@pytest.fixture(scope="module")
def two_steps(grpo_example, tmp_path_factory):
    """SFT (60 steps: some completions match, so GRPO has a gradient), then 2 GRPO loop steps validating every 2:
    the project's ModelCheckpoint writes last.ckpt."""
    root = tmp_path_factory.mktemp("example")
    return root, grpo_example.main(["--root", str(root), "--sft-steps", "60", "--loop-steps", "2", "--val-every", "2"])


def _rows(log_dir: Path) -> list[dict]:
    with open(log_dir / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if not is_timing(k)} for r in csv.DictReader(f)]


@pytest.mark.slow
def test_example_runs_sft_then_two_grpo_loop_steps(two_steps, grpo_example):
    root, trainer = two_steps
    log_dir = Path(trainer.log_dir)
    assert log_dir == root / "grpo" / "version_0"  # the project's own CSVLogger
    rows = _rows(log_dir)
    steps = [r for r in rows if r["reward/mean"]]
    assert [(r["step"], r["global_step"]) for r in steps] == [("1", "2.0"), ("2", "4.0")]  # n_mini = 2
    assert all("reward/exact_match" in r for r in steps)  # the project's reward, through compute_rewards
    assert [r["step"] for r in rows if r["val/reward"]] == ["2"]  # validation every 2 loop steps
    assert any(r.get("lr-AdamW") for r in rows)  # the project's LearningRateMonitor still runs
    assert (log_dir / "checkpoints" / "last.ckpt").is_file()  # and its ModelCheckpoint
    handoff = next(cb for cb in trainer.callbacks if isinstance(cb, grpo_example.HandoffCallback))
    assert handoff.events.count("train") == 2


@pytest.mark.slow
def test_example_resumes_through_its_own_model_checkpoint_exactly(two_steps, grpo_example, tmp_path):
    """last.ckpt of the 2-step run (written by the project's ModelCheckpoint when validation ended), resumed to
    4 loop steps, continues exactly as a 4-step run that was never interrupted: every row, every parameter."""
    root, _ = two_steps
    args = ["--sft-steps", "60", "--loop-steps", "4", "--val-every", "2"]  # 60: enough that rewards vary
    whole = grpo_example.main(["--root", str(tmp_path), *args])
    last = root / "grpo" / "version_0" / "checkpoints" / "last.ckpt"
    resumed = grpo_example.main(["--root", str(root), *args, "--ckpt-path", str(last)])
    assert Path(resumed.log_dir) == root / "grpo" / "version_1"
    rows = _rows(Path(whole.log_dir))
    cut = next(i for i, r in enumerate(rows) if r["val/reward"] and r["step"] == "2") + 1  # after loop step 2
    expected = rows[cut:]
    assert [r["step"] for r in expected if r["reward/mean"]] == ["3", "4"]
    assert _rows(Path(resumed.log_dir)) == expected  # training and validation rows, LR monitor included
    a, b = whole.lightning_module.policy.state_dict(), resumed.lightning_module.policy.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    at_2 = torch.load(last, weights_only=True)["state_dict"]
    assert any(not torch.equal(at_2[f"policy.{k}"], a[k]) for k in a)  # loop steps 3-4 really moved the policy


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
