"""GRPOCheckpoint: complete, atomic checkpoints every N collected batches, owned by their run, beside the config.

What the update depends on travels in every checkpoint whoever writes it (``GRPOModule``'s own
``on_save_checkpoint``, see ``checkpoint/state.py``); this callback only adds what is ours to add:
the cadence in loop steps, atomic IO, the run's ownership of its files (lineage ids, a manifest
with a content hash, a folder lock, pruning of its own files only), the config beside each file,
and the emergency save on SIGTERM / SIGUSR1 (``signals.py``).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from typing_extensions import override

from lightning_grpo.checkpoint.checkpoint_io import AtomicCheckpointIO
from lightning_grpo.checkpoint.emergency import (
    failure_reason,
    refusal,
    report_refusal,
    report_saved,
)
from lightning_grpo.checkpoint.integrity import (
    Manifest,
    mark_validation,
)
from lightning_grpo.checkpoint.lock import FolderLock, take_folder
from lightning_grpo.checkpoint.paths import (
    checkpoint_name,
    find_last_checkpoint,
)
from lightning_grpo.checkpoint.revalidate import rerun_validation, validation_pending
from lightning_grpo.checkpoint.shared import check_every_rank_sees
from lightning_grpo.checkpoint.signals import Preempted, SignalWatch
from lightning_grpo.checkpoint.staging import publish_staged, stage
from lightning_grpo.checkpoint.state import NonFiniteParametersError, trained_loop_step

log = logging.getLogger(__name__)


class GRPOCheckpoint(Checkpoint):
    """Saves a complete checkpoint every ``every_n_loop_steps`` collected batches, atomically, beside its config.

    Cadence is in loop steps (``GRPOModule.loop_step``), whatever ``n_mini`` is. Lightning's
    ``global_step`` counts ``optimizer.step()`` calls: loop steps x n_mini, less every window
    skipped for a non-finite loss, so a ``global_step`` cadence would drift off the batch
    boundary. While attached it also installs ``AtomicCheckpointIO`` (if the strategy uses the
    stock ``TorchCheckpointIO``), so every checkpoint of the run is written atomically and verified
    against its manifest when loaded.

    Each fit gets a run id and belongs to a lineage (a resumed fit continues the lineage of its
    checkpoint): names carry the lineage (``loop-step-000020-1a2b3c4d.ckpt``), a manifest beside each
    file records both ids and a SHA-256, ``keep_last`` prunes only this lineage's files, and a lock
    keeps a second live run out of the folder. Parameters holding NaN/inf are never saved.

    Args:
        dirpath: folder of the checkpoints; None = ``<trainer.log_dir>/checkpoints`` (one folder per
            run version; ``--ckpt_path last`` searches the versions of the experiment).
        every_n_loop_steps: save after every n-th loop step; 0 = no scheduled saves.
        keep_last: checkpoints of this run's lineage kept in ``dirpath`` (older ones deleted after a
            save); 0 = all. Other runs' files are never deleted.
        save_on_train_end: also save when fit ends, unless that loop step was just saved.
        save_on_signal: on SIGTERM / SIGUSR1 (preemption, SLURM), save at the next batch boundary (or
            validation batch) and exit with ``128 + signal number`` (see ``signals.py``).

    Raises:
        ValueError: a knob out of range (all problems listed at once).

    Example::

        trainer = Trainer(max_steps=100, callbacks=[GRPOCheckpoint(every_n_loop_steps=10, keep_last=3)])
        trainer.fit(GRPOModule(), datamodule=PromptDataModule())  # killed at loop step 57: 50 is the newest
        trainer = Trainer(max_steps=100, callbacks=[GRPOCheckpoint(every_n_loop_steps=10, keep_last=3)])
        trainer.fit(GRPOModule(), datamodule=PromptDataModule(), ckpt_path=resolve_ckpt_path("last", trainer))
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_loop_steps: int = 10,
        keep_last: int = 2,
        save_on_train_end: bool = True,
        save_on_signal: bool = True,
    ) -> None:
        problems = []
        if not isinstance(every_n_loop_steps, int) or every_n_loop_steps < 0:
            problems.append(
                f"every_n_loop_steps={every_n_loop_steps!r}: must be an integer >= 0 (0 = no schedule)"
            )
        if not isinstance(keep_last, int) or keep_last < 0:
            problems.append(
                f"keep_last={keep_last!r}: must be an integer >= 0 (0 = keep every checkpoint)"
            )
        if problems:
            raise ValueError("GRPOCheckpoint(" + "; ".join(problems) + ")")
        self.every_n_loop_steps = every_n_loop_steps
        self.keep_last = keep_last
        self.save_on_train_end = save_on_train_end
        self.save_on_signal = save_on_signal
        self.explicit_dirpath = dirpath is not None
        """Whether ``dirpath`` was given (then ``--ckpt_path last`` searches only there)."""
        self.dirpath: Path | None = Path(dirpath) if dirpath else None
        self.run_id: str | None = None
        """This fit's id (8 hex digits)."""
        self.lineage: str | None = None
        """The lineage this fit writes: its own run id, or the resumed checkpoint's lineage."""
        self._loaded_lineage: str | None = None
        self._parent: str | None = None
        self._last_saved: int | None = None
        self.last_path: Path | None = None
        """The newest checkpoint this callback wrote."""
        self._lock: FolderLock | None = None
        self._signals = SignalWatch()
        # saved, not yet published (see on_train_batch_end)
        self._pending: tuple[Path, Manifest | None] | None = None
        # the signal every rank agreed on, acted on after the step's row
        self._stop: int | None = None
        self._save_failed = False
        self._in_fit = False
        # what --ckpt_path resolved to on this rank (resume_from)
        self._resumed: str | None = None

    # -- hooks -------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # a custom IO is the user's choice
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if not self.explicit_dirpath:
            self.dirpath = (
                Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"
            )
        # one id for every rank
        self.run_id = trainer.strategy.broadcast(secrets.token_hex(4))
        # before Lightning loads it on each rank
        check_every_rank_sees(trainer, self._resumed)
        self._resumed = None  # a later fit resolves its own
        self._loaded_lineage = None
        self._last_saved = None
        self._save_failed = False
        self._pending = None
        self._stop = None

    def resume_from(self, path: str | os.PathLike | None) -> None:
        """The checkpoint this rank will load (``resolve_ckpt_path``); every rank's is compared at setup."""
        self._resumed = None if path is None else str(path)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"lineage": self.lineage, "run": self.run_id}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # a resume continues this lineage (on_train_start)
        self._loaded_lineage = state_dict.get("lineage")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        resumed = trainer.ckpt_path is not None
        self.lineage = (
            self._loaded_lineage if resumed and self._loaded_lineage else self.run_id
        )
        self._parent = str(trainer.ckpt_path) if resumed else None
        self._take_folder(trainer)
        # from here to the end of fit: publishes after rows, validation marks, emergency saves
        self._in_fit = True
        if self.save_on_signal:
            self._signals.install(trainer)
        if resumed and validation_pending(trainer.ckpt_path):
            rerun_validation(trainer)

    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        # Saved here, at the batch boundary, but published (renamed into place) only once Lightning has written this
        # loop step's metrics row, right after this hook: a checkpoint of step K never exists without row K, so a
        # kill -9 just after the publish, or a signal, loses no row. The signal is agreed on here (a collective).
        step = trained_loop_step(trainer)
        signum = self._signals.pending(trainer) if self._signals.active else None
        scheduled = (
            bool(self.every_n_loop_steps) and step % self.every_n_loop_steps == 0
        )
        if scheduled or signum is not None:
            reason = (
                "scheduled" if scheduled else f"signal:{signal.Signals(signum).name}"
            )
            self.save(trainer, step, reason, publish_now=False)
        self._stop = signum

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._after_row(trainer)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not self._in_fit:
            return
        # marked done at its end (a resume re-runs it)
        self._after_row(trainer, validation="pending")

    @override
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        # a validation inside fit: stop at the batch
        if self._signals.active and not trainer.sanity_checking:
            self._stop = self._signals.pending(trainer)
            if self._stop is not None:
                self._stop_now(
                    trainer, trained_loop_step(trainer), validation="pending"
                )

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = trained_loop_step(trainer)
        if (
            self._in_fit
            and not trainer.sanity_checking
            and self._last_saved == step
            and trainer.is_global_zero
        ):
            mark_validation(self.last_path, "done")

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._after_row(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._after_row(trainer)
        step = trained_loop_step(trainer)
        if self.save_on_train_end and step > 0 and step != self._last_saved:
            self.save(trainer, step, reason="train_end")
        self._let_go()

    @override
    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        try:
            # a finished save of a boundary whose row was written
            self._publish_pending(trainer)
            if self._in_fit and not isinstance(exception, Preempted):
                self._emergency_save(trainer, exception)
        finally:
            self._let_go()

    @override
    def teardown(
        self, trainer: Trainer, pl_module: LightningModule, stage: str
    ) -> None:
        self._let_go()

    # -- saving ------------------------------------------------------------------------------------------------------
    def save(
        self,
        trainer: Trainer,
        loop_step: int,
        reason: str = "scheduled",
        publish_now: bool = True,
    ) -> Path | None:
        """Config beside it first, then the checkpoint under a staging name, its manifest, the rename, then prune
        (``staging.py``). Returns None, saving nothing, when a parameter holds NaN/inf. ``publish_now=False``
        leaves the finished save staged until ``_publish_pending`` (after the step's row).
        """
        self._publish_pending(trainer)
        path = self.dirpath / checkpoint_name(loop_step, self.lineage)
        try:
            manifest = stage(
                trainer,
                path,
                lineage=self.lineage,
                run=self.run_id,
                loop_step=loop_step,
                reason=reason,
                parent=self._parent,
            )
        except BaseException as err:
            # no emergency save retries it on the way out (a full disk stays full)
            self._save_failed = True
            # every rank alike: the check is a collective
            if isinstance(err, NonFiniteParametersError):
                return None
            raise
        self._last_saved = loop_step
        self.last_path = path
        self._pending = (path, manifest)
        if publish_now:
            self._publish_pending(trainer)
        return path

    def _publish_pending(self, trainer: Trainer, validation: str | None = None) -> None:
        """Manifest, rename into place, prune: the staged save becomes a checkpoint (rank 0 writes)."""
        if self._pending is None:
            return
        path, manifest = self._pending
        self._pending = None
        if trainer.is_global_zero:
            publish_staged(path, manifest, validation, self.keep_last)

    def _after_row(self, trainer: Trainer, validation: str | None = None) -> None:
        """The first hook after Lightning wrote the loop step's metrics row: publish, then act on a signal."""
        self._publish_pending(trainer, validation)
        if self._stop is not None:
            self._stop_now(trainer, trained_loop_step(trainer), validation)

    def _stop_now(
        self, trainer: Trainer, loop_step: int, validation: str | None = None
    ) -> None:
        """Save the boundary (unless saved), run the wrapped handler (Lightning's / SLURM requeue), exit non-zero."""
        signum = self._stop
        self._stop = None
        if self._last_saved != loop_step:
            self.save(
                trainer,
                loop_step,
                f"signal:{signal.Signals(signum).name}",
                publish_now=False,
            )
        self._publish_pending(trainer, validation)
        if (
            validation == "pending"
            and trainer.is_global_zero
            and self.last_path is not None
        ):
            # saved before this validation: a resume re-runs it
            mark_validation(self.last_path, "pending")
        # Lightning's own handler, now at the boundary (SLURM: hpc save + requeue)
        self._signals.forward(signum)
        stop = Preempted(
            signum,
            self.last_path
            if self._last_saved == loop_step
            else "(none: non-finite parameters)",
            loop_step,
        )
        if trainer.is_global_zero:
            log.warning("%s", stop)
        raise stop

    def _emergency_save(self, trainer: Trainer, exception: BaseException) -> None:
        """A run failing inside a loop step, before its first optimizer step, saves the batch boundary it left
        (``emergency.py``: when it may, and why that repeats the failed loop step exactly)."""
        step = trained_loop_step(trainer)
        if step == 0 or step == self._last_saved:
            return
        why = refusal(trainer, self._save_failed)
        if why is not None:
            if trainer.is_global_zero:
                newest = find_last_checkpoint([self.dirpath], self.lineage)
                report_refusal(step, why, newest)
            return
        try:
            path = self.save(trainer, step, failure_reason(exception))
        except Exception as err:  # noqa: BLE001 - the run's own failure is what the user must see
            log.error("emergency checkpoint of loop step %d failed: %s", step, err)
            return
        signum = getattr(exception, "signum", None)
        if signum:
            self._signals.forward(signum)
        report_saved(step, path, signum)

    # -- ownership and signals ----------------------------------------------------------------------------------------
    def _take_folder(self, trainer: Trainer) -> None:
        """Lock the folder for this run (rank 0; every rank raises if another live run holds it)."""
        if trainer.is_global_zero:
            self._lock = FolderLock(self.dirpath)
        take_folder(trainer, self._lock, self.run_id, self.lineage)

    def _let_go(self) -> None:
        self._in_fit = False
        self._signals.restore()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
