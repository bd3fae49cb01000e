"""The LR schedule's horizon: resolved from the config or the Trainer, refused when there is none."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import StepRecorder
from lightning.pytorch import Callback, Trainer

from lightning_grpo.config import ConfigError, GRPOConfig, OptimConfig, RolloutConfig
from lightning_grpo.data.prompts import PromptDataModule
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.schedule import build_scheduler, check_horizon, run_length, schedule_horizon


def module_with(policy_dir, **optim) -> GRPOModule:
    """2 prompts x 4 completions of 4 tokens, n_mini = 2 (so optimizer steps = 2 x loop steps)."""
    rl = GRPOConfig(batch_per_replica=8, group_size=4, mini_batch_per_replica=4)
    return GRPOModule(policy=PolicyConfig(path=str(policy_dir)), rl=rl, optim=OptimConfig(**optim),
                      rollout=RolloutConfig(max_new_tokens=4))


class FailIfTrained(Callback):
    def on_train_batch_end(self, *args):
        raise AssertionError("an endless run trained with a decaying schedule")


def fit(module, root, *callbacks, **trainer_kwargs) -> StepRecorder:
    recorder = StepRecorder()
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, default_root_dir=root, callbacks=[recorder, *callbacks],
                      **trainer_kwargs)
    trainer.fit(module, datamodule=PromptDataModule("builtin:arith", val_size=0))
    return recorder


def cosine(step: int, horizon: int, peak: float) -> float:
    return peak * 0.5 * (1 + math.cos(math.pi * step / horizon))


def test_sweep_setup_decays_the_cosine_over_its_epoch(tiny_policy_dir, tmp_path):
    """configs/sweep.yaml's trainer: max_steps=-1, max_epochs=1, limit_train_batches=N. Was lr, 0, 0, 0 (horizon 1)."""
    module = module_with(tiny_policy_dir, lr=1e-3, schedule="cosine")
    rows = fit(module, tmp_path, max_steps=-1, max_epochs=1, limit_train_batches=4).metrics
    # Each loop step logs the mean and the max lr of its 2 optimizer steps (2j, 2j + 1).
    expected = [[cosine(k, 8, 1e-3) for k in (2 * j, 2 * j + 1)] for j in range(4)]
    assert [r["grpo/lr_max"] for r in rows] == pytest.approx([max(e) for e in expected], rel=1e-6)
    assert [r["grpo/lr"] for r in rows] == pytest.approx([sum(e) / 2 for e in expected], rel=1e-6)
    assert rows[-1]["grpo/lr"] > 0.02e-3  # still decaying at the end of the epoch, not collapsed to 0
    assert module.schedule_horizon == 8  # 4 loop steps x n_mini 2


def test_endless_run_with_a_decaying_schedule_is_refused_naming_total_steps(tiny_policy_dir, tmp_path):
    module = module_with(tiny_policy_dir, schedule="cosine")
    with pytest.raises(ValueError, match="optim.total_steps"):
        fit(module, tmp_path, FailIfTrained(), max_steps=-1, max_epochs=-1)
    assert module.updater is None  # refused at setup, before the model (and its updater) is built


def trainer_like(max_steps=-1, stepping_batches=math.inf):
    """What ``run_length`` reads of a Trainer: max_steps and Lightning's estimate (batches = loop steps)."""
    return SimpleNamespace(max_steps=max_steps, estimated_stepping_batches=stepping_batches)


@pytest.mark.parametrize("total_steps,trainer,n_mini,expected", [
    (50, trainer_like(400, 400), 4, 50),  # optim.total_steps wins
    (0, trainer_like(400, 400), 4, 400),  # max_steps: optimizer steps already
    (0, trainer_like(-1, 20), 2, 40),  # max_epochs x limit_train_batches loop steps, x n_mini
    (0, trainer_like(400, 20), 4, 80),  # both set: the epochs end the run first (Lightning caps its estimate)
    (0, trainer_like(10, 10), 4, 10),  # ... or max_steps does
    (0, trainer_like(-1, -1), 2, None),  # an endless iterable epoch with no max_steps
    (0, trainer_like(-1, math.inf), 2, None),  # max_epochs=-1
    (0, None, 2, None),  # no Trainer
])
def test_horizon_resolution(total_steps, trainer, n_mini, expected):
    assert schedule_horizon(OptimConfig(total_steps=total_steps), trainer, n_mini) == expected


def test_total_steps_shorter_than_the_run_is_refused():
    optim = OptimConfig(schedule="cosine", total_steps=100)
    check_horizon(optim, 100, run_length(trainer_like(100, 100), 1))
    with pytest.raises(ValueError, match="optim.total_steps=100 is shorter than the run"):
        check_horizon(optim, 100, run_length(trainer_like(400, 400), 1))
    check_horizon(OptimConfig(schedule="constant"), None, None)  # a constant schedule needs no horizon


def test_warmup_reaching_total_steps_is_refused_at_load():
    with pytest.raises(ConfigError, match="warmup_steps=10: must be below total_steps=10"):
        OptimConfig(schedule="cosine", warmup_steps=10, total_steps=10)


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_schedules_are_transformers_with_warmup_from_zero(schedule):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, OptimConfig(lr=1.0, warmup_steps=2, schedule=schedule), horizon=6)
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    decay = {"constant": [1.0] * 5, "cosine": [cosine(k, 4, 1.0) for k in range(5)], "linear": [1, 0.75, 0.5, 0.25, 0]}
    assert lrs == pytest.approx([0.0, 0.5, *decay[schedule]])
