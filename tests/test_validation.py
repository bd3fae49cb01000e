"""Validation during fit: greedy, through the module's engine, after the hand-off published the current policy."""

from __future__ import annotations

import csv

import pytest
from helpers import SMALL
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig
from lightning_grpo.data.prompts import PromptDataModule
from lightning_grpo.data.rewards import RewardSpec
from lightning_grpo.handoff import CYCLE, ENGINE_SLEEP, TRAINER_ONLOAD, HandoffCallback
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.validation import greedy_scores

PUBLISH, STEP = list(CYCLE[4:]), list(CYCLE[:4])  # wake weights, sync, offload, wake KV | generate, sleep, onload, train


def make_module() -> GRPOModule:
    seed_everything(0)
    return GRPOModule(policy=PolicyConfig(path="tiny:validation", tiny=SMALL),
                      rl=GRPOConfig(batch_per_replica=8, group_size=4), optim=OptimConfig(lr=1e-2),
                      rollout=RolloutConfig(max_new_tokens=3), rewards=[RewardSpec("arith")])


def fit(tmp_path, name: str, val_every: int | None) -> tuple[HandoffCallback, list[dict]]:
    """2 loop steps with host offload forced on (the trainer really leaves on CPU), validating every ``val_every``."""
    handoff = HandoffCallback(offload_backend="host")
    trainer = Trainer(max_steps=2, logger=CSVLogger(tmp_path, name=name), callbacks=[handoff], log_every_n_steps=1,
                      val_check_interval=val_every, limit_val_batches=None if val_every else 0,
                      num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(make_module(), datamodule=PromptDataModule("builtin:arith", val_size=8))
    with open(tmp_path / name / "version_0" / "metrics.csv", newline="") as f:
        return handoff, list(csv.DictReader(f))


@pytest.mark.slow
def test_validation_runs_after_publication_and_leaves_training_unchanged(tmp_path):
    handoff, rows = fit(tmp_path, "val", val_every=1)
    # each validation publishes the updated policy first; the next loop step then generates at once
    assert handoff.events == [ENGINE_SLEEP, *PUBLISH, *STEP, *PUBLISH, *STEP, *PUBLISH, ENGINE_SLEEP, TRAINER_ONLOAD]
    val = [r for r in rows if r["val/reward"]]
    assert [r["step"] for r in val] == ["1", "2"]  # x-axis: the loop step validated
    assert all(0 <= float(r["val/reward"]) <= 1 and float(r["val/len_mean"]) <= 3 for r in val)
    # the greedy draw runs on its own RNG stream: the training rollouts and updates are those of a run without it
    _, plain = fit(tmp_path, "plain", val_every=None)
    train = [{k: v for k, v in r.items() if k != "grpo/ahead_seconds" and not k.startswith("val/")}
             for r in rows if r["reward/mean"]]
    assert train == [{k: v for k, v in r.items() if k != "grpo/ahead_seconds"} for r in plain]


def test_validation_is_one_greedy_completion_per_prompt_from_the_engine():
    module = make_module()
    module.configure_model()
    module.engine = module.build_engine(will_sleep=False)
    calls = []
    generate = module.engine.generate
    module.engine.generate = lambda prompts, g, sampling: calls.append((len(prompts), g, sampling)) or generate(
        prompts, g, sampling)
    records = PromptDataModule("builtin:arith", prompts_per_step=4, val_size=4).val_batches()[0]
    first, again = greedy_scores(module, records), greedy_scores(module, records)
    (n, group, sampling), _ = calls
    assert (n, group, sampling.temperature, sampling.max_new_tokens) == (4, 1, 0.0, 3)
    assert first == again  # greedy: the same completions every time
    assert set(first) == {"val/reward", "val/reward/arith", "val/reward/none_frac", "val/len_mean", "val/stop_frac"}


def test_validation_refuses_an_engine_left_asleep():
    """Generating while the hand-off has the engine asleep would sample from released memory: it raises."""
    module = make_module()
    module.configure_model()
    module.engine = module.build_engine(will_sleep=False)
    module.engine.sleep(1)
    records = PromptDataModule("builtin:arith", prompts_per_step=4, val_size=4).val_batches()[0]
    with pytest.raises(RuntimeError, match="asleep"):
        greedy_scores(module, records)
