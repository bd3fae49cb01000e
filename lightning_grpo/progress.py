"""Progress bars that count loop steps: ``n/total`` = collected batches done / in the run, also after a resume.

Under manual optimization Lightning's stock bars mix units. They count training batches (= loop
steps here) but take their total from ``max_steps``, which counts optimizer steps (loop steps x
``mu_iterations x n_mini``): a 3-loop-step run at ``n_mini = 2`` ends on "3/6". A resumed run keeps counting from the
restored batch while the total shrinks to the optimizer steps left ("40/29"), and the rich bar
titles itself "Epoch 0/-2" because ``max_steps`` sets ``max_epochs = -1``. The two bars below keep
every argument and look of Lightning's, fix the numbers and drop ``v_num``; ``UpdateModule.setup``
(``base.py``) swaps a stock bar for its twin, so the CLI and a plain ``Trainer`` both get them.
"""

from __future__ import annotations

import math

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from typing_extensions import override


def loop_steps_total(trainer: Trainer, done: int) -> int | float:
    """Loop steps this epoch holds: ``done`` so far plus those ``max_steps`` leaves, capped by the epoch's length.

    Recomputed after every loop step, so a skipped (non-finite) window, which takes no optimizer step,
    lengthens the run and the total with it.
    """
    total = trainer.num_training_batches  # inf: the prompt stream never ends an epoch
    if trainer.max_steps is not None and trainer.max_steps >= 0:  # -1: no step limit
        left = max(trainer.max_steps - trainer.global_step, 0)
        # optimizer steps one loop step takes when no window is skipped (UpdateModule's; 1 for any other module)
        steps = int(getattr(trainer.lightning_module, "steps_per_loop_step", 1))
        total = min(total, done + math.ceil(left / steps))
    return total


def _done(trainer: Trainer) -> int:
    """Loop steps already taken in this epoch (nonzero on a resumed run)."""
    return trainer.fit_loop.epoch_loop.batch_idx + 1


class GRPOProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar counting loop steps against the run's loop steps (same arguments).

    Example::

        Trainer(callbacks=[GRPOProgressBar(refresh_rate=10)])
    """

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict:
        return _without_version(super().get_metrics(trainer, pl_module))

    @property
    @override
    def total_train_batches(self) -> int | float:
        return loop_steps_total(self.trainer, _done(self.trainer))

    @override
    def on_train_start(self, trainer: Trainer, *args) -> None:
        super().on_train_start(trainer, *args)
        if _done(trainer):  # resumed mid-epoch: Lightning calls no on_train_epoch_start
            self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch}")
            self._start_at(trainer)

    @override
    def on_train_epoch_start(self, trainer: Trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)
        self._start_at(trainer)

    def _start_at(self, trainer: Trainer) -> None:
        """A resumed run starts at the loop steps it had taken (and its rate counts from there)."""
        bar = self.train_progress_bar
        bar.total = convert_inf(self.total_train_batches)
        bar.n = bar.initial = _done(trainer)
        bar.refresh()

    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs,
        batch,
        batch_idx: int,
    ) -> None:
        self.train_progress_bar.total = convert_inf(
            loop_steps_total(trainer, batch_idx + 1)
        )
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class GRPORichProgressBar(RichProgressBar):
    """Lightning's rich bar counting loop steps against the run's loop steps (same arguments).

    Example::

        Trainer(callbacks=[GRPORichProgressBar(leave=True)])
    """

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict:
        return _without_version(super().get_metrics(trainer, pl_module))

    @property
    @override
    def total_train_batches(self) -> int | float:
        return loop_steps_total(self.trainer, _done(self.trainer))

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        # unbounded: not "Epoch 0/-2"
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"
        return super()._get_train_description(current_epoch)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # resumed mid-epoch (no on_train_epoch_start): start there
        if _done(trainer) and not self.is_disabled:
            self._initialize_train_progress_bar_id()
            self._update(self.train_progress_bar_id, _done(trainer))

    @override
    def on_train_epoch_start(
        self, trainer: Trainer, pl_module: LightningModule
    ) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        # nonzero when resumed at an epoch's end
        self._update(self.train_progress_bar_id, _done(trainer))

    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs,
        batch,
        batch_idx: int,
    ) -> None:
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(
                self.train_progress_bar_id,
                total=loop_steps_total(trainer, batch_idx + 1),
            )
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def _without_version(metrics: dict) -> dict:
    """The bar's metrics less Lightning's ``v_num`` (the logger's version: the run folder's name already says it,
    and the rich bar printed it as a float, ``v_num: 0.000``)."""
    metrics.pop("v_num", None)
    return metrics


_TWINS = {TQDMProgressBar: GRPOProgressBar, RichProgressBar: GRPORichProgressBar}


def count_loop_steps(trainer: Trainer) -> None:
    """Turn the trainer's stock Lightning bar (exact class: not a user's subclass) into its loop-step twin.

    The twin adds no constructor argument and no state, so the instance is re-classed in place: every
    argument the user gave (refresh rate, theme, ...) is kept, and Lightning's default bar is covered too.
    """
    for callback in trainer.callbacks:
        twin = _TWINS.get(type(callback))
        if twin is not None:
            callback.__class__ = twin
