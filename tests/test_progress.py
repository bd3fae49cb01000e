"""The progress bar counts loop steps against the run's loop steps: on a fresh run, after a resume, for both bars."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
from helpers import global_determinism_restored, tiny_grpo_module
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger

from lightning_grpo.checkpoint import GRPOCheckpoint, complete_checkpoints
from lightning_grpo.config import GRPOConfig
from lightning_grpo.data.preference_module import PreferenceDataModule
from lightning_grpo.data.prompts import PromptDataModule
from lightning_grpo.dpo import DPOConfig, DPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.progress import GRPOProgressBar, GRPORichProgressBar, loop_steps_total


class BarReader(Callback):
    """Reads what the bar shows (count, total, title) after it has drawn each loop step; placed after the bar."""

    def __init__(self):
        self.shown, self.at_start = [], None

    @staticmethod
    def read(bar) -> tuple[int, float, str]:
        if isinstance(bar, RichProgressBar):
            task = bar.progress.tasks[bar.train_progress_bar_id]
            return int(task.completed), task.total, task.description.strip()
        return bar.train_progress_bar.n, bar.train_progress_bar.total, bar.train_progress_bar.desc.rstrip(": ")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.at_start is None:  # what the bar shows before the run's first loop step
            self.at_start = self.read(trainer.progress_bar_callback)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.shown.append(self.read(trainer.progress_bar_callback)[:2])


def _fit(module, root, max_steps: int, bar, ckpt_path=None) -> BarReader:
    reader = BarReader()
    saver = GRPOCheckpoint(dirpath=root / "ckpt", every_n_loop_steps=2)
    trainer = Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_model_summary=False,
                      default_root_dir=root, callbacks=[bar, reader, saver])
    with global_determinism_restored():
        trainer.fit(module, datamodule=PromptDataModule("builtin:arith", val_size=0), ckpt_path=ckpt_path)
    return reader


@pytest.mark.heavy  # two fits per bar: CI and `make test-integration`
@pytest.mark.parametrize("bar_class", [TQDMProgressBar, RichProgressBar])
def test_the_bar_counts_loop_steps_on_a_fresh_run_and_after_a_resume(bar_class, tiny_policy_dir, tmp_path):
    """n_mini = 2: max_steps=4 optimizer steps is 2 loop steps; the resumed run to max_steps=10 shows 3/5 .. 5/5.

    Lightning's stock bars showed "1/4, 2/4" (total in optimizer steps), then "3/6, 4/6, 5/6" after the resume
    (total = optimizer steps left, count = batches since the start) and titled the rich bar "Epoch 0/-2".
    """
    fresh = _fit(tiny_grpo_module(tiny_policy_dir), tmp_path, max_steps=4, bar=bar_class())
    assert fresh.shown == [(1, 2), (2, 2)]
    assert fresh.at_start[:2] == (0, 2) and fresh.at_start[2] == "Epoch 0"  # not "Epoch 0/-2"
    last = complete_checkpoints(tmp_path / "ckpt")[-1]
    resumed = _fit(tiny_grpo_module(tiny_policy_dir), tmp_path, max_steps=10, bar=bar_class(), ckpt_path=last)
    assert resumed.at_start == (2, 5, "Epoch 0")  # starts at the restored loop step
    assert resumed.shown == [(3, 5), (4, 5), (5, 5)]


def test_stock_bars_become_their_loop_step_twins_keeping_their_arguments(tiny_policy_dir, tmp_path):
    tqdm_bar = TQDMProgressBar(refresh_rate=3, leave=True)
    _fit(tiny_grpo_module(tiny_policy_dir), tmp_path, max_steps=2, bar=tqdm_bar)
    assert type(tqdm_bar) is GRPOProgressBar and tqdm_bar.refresh_rate == 3 and tqdm_bar._leave
    default = Trainer(max_steps=2, accelerator="cpu", logger=False, enable_model_summary=False,
                      default_root_dir=tmp_path)  # Lightning adds its own bar: rich where rich is installed
    with global_determinism_restored():
        default.fit(tiny_grpo_module(tiny_policy_dir), datamodule=PromptDataModule("builtin:arith", val_size=0))
    assert type(default.progress_bar_callback) in (GRPOProgressBar, GRPORichProgressBar)


class OwnBar(TQDMProgressBar):
    """A user's own bar: left as it is."""


def test_a_users_own_bar_subclass_is_left_alone(tiny_policy_dir, tmp_path):
    bar = OwnBar()
    _fit(tiny_grpo_module(tiny_policy_dir), tmp_path, max_steps=2, bar=bar)
    assert type(bar) is OwnBar


class MetricsReader(BarReader):
    """Also reads the metrics the bar shows beside the count."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.metrics = trainer.progress_bar_callback.get_metrics(trainer, pl_module)


@pytest.mark.parametrize("bar_class", [TQDMProgressBar, RichProgressBar])
def test_a_dpo_run_counts_loop_steps_and_no_bar_shows_v_num(bar_class, tiny_policy_dir, tmp_path):
    """A DPO run kept Lightning's stock bar ("Epoch 0/-2" with max_steps), and every bar showed `v_num: 0.000`.
    Without held-out pairs no "Total length of `list` across ranks is zero" warning either."""
    bar, reader = bar_class(), MetricsReader()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Total length of")
        _fit_dpo(tiny_policy_dir, tmp_path, [bar, reader])
    assert type(bar) in (GRPOProgressBar, GRPORichProgressBar)
    assert reader.at_start == (0, 2, "Epoch 0") and reader.shown == [(1, 2), (2, 2)]
    assert "v_num" not in reader.metrics and {"loss", "acc"} <= reader.metrics.keys()


def _fit_dpo(tiny_policy_dir, tmp_path, callbacks) -> None:
    trainer = Trainer(max_steps=2, accelerator="cpu", devices=1, logger=CSVLogger(tmp_path), enable_model_summary=False,
                      enable_checkpointing=False, default_root_dir=tmp_path, callbacks=callbacks)
    module = DPOModule(PolicyConfig(path=str(tiny_policy_dir)), DPOConfig(batch_size=4))
    with global_determinism_restored():
        trainer.fit(module, datamodule=PreferenceDataModule("builtin:arith_small", val_size=0))


def _trainer(max_steps: int, global_step: int, n_mini: int, batches: float = math.inf, mu: int = 1):
    rl = GRPOConfig(batch_per_replica=2 * n_mini, group_size=2, mini_batch_per_replica=2, mu_iterations=mu)
    module = SimpleNamespace(steps_per_loop_step=rl.steps_per_loop_step)  # UpdateModule's property
    return SimpleNamespace(num_training_batches=batches, max_steps=max_steps, global_step=global_step,
                           lightning_module=module)


def test_total_in_loop_steps_follows_skipped_windows_and_epoch_limits():
    assert loop_steps_total(_trainer(max_steps=6, global_step=0, n_mini=2), done=0) == 3
    assert loop_steps_total(_trainer(max_steps=6, global_step=4, n_mini=2), done=2) == 3
    # a skipped (non-finite) window took no optimizer step: one more loop step is needed, the total grows
    assert loop_steps_total(_trainer(max_steps=6, global_step=3, n_mini=2), done=2) == 4
    assert loop_steps_total(_trainer(max_steps=5, global_step=0, n_mini=2), done=0) == 3  # Lightning stops at >= 5
    assert loop_steps_total(_trainer(max_steps=-1, global_step=8, n_mini=2, batches=20), done=4) == 20  # sweep form
    assert loop_steps_total(_trainer(max_steps=100, global_step=0, n_mini=1, batches=20), done=0) == 20
    assert loop_steps_total(_trainer(max_steps=12, global_step=0, n_mini=2, mu=3), done=0) == 2  # mu x n_mini a step
    assert loop_steps_total(_trainer(max_steps=-1, global_step=0, n_mini=1), done=0) == math.inf
