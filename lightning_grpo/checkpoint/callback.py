"""GRPOCheckpoint: complete, atomic checkpoints every N collected batches, beside the resolved config.

What the update depends on travels in every checkpoint whoever writes it (``GRPOModule``'s own
``on_save_checkpoint``, see ``checkpoint/state.py``); this callback only adds what is ours to add:
the cadence in loop steps, atomic IO, keep-last pruning and the config beside each file.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from typing_extensions import override

from lightning_grpo.checkpoint.atomic import AtomicCheckpointIO, atomic_write
from lightning_grpo.checkpoint.paths import (
    checkpoint_name,
    complete_checkpoints,
    config_path,
    prune,
    publish,
    staging_path,
)

log = logging.getLogger(__name__)


class GRPOCheckpoint(Checkpoint):
    """Saves a complete checkpoint every ``every_n_loop_steps`` collected batches, atomically, beside its config.

    Cadence is in loop steps (``GRPOModule.loop_step``), whatever ``n_mini`` is. Lightning's
    ``global_step`` counts ``optimizer.step()`` calls: loop steps x n_mini, less every window
    skipped for a non-finite loss, so a ``global_step`` cadence would drift off the batch
    boundary. While attached it also installs ``AtomicCheckpointIO`` (if the strategy uses the
    stock ``TorchCheckpointIO``), so every checkpoint of the run is written atomically.

    Args:
        dirpath: folder of the checkpoints; None = ``<trainer.log_dir>/checkpoints`` (one folder per
            run version; ``--ckpt_path last`` searches the versions of the experiment).
        every_n_loop_steps: save after every n-th loop step; 0 = no scheduled saves.
        keep_last: complete checkpoints kept in ``dirpath`` (older ones deleted after a save); 0 = all.
        save_on_train_end: also save when fit ends, unless that loop step was just saved.

    Raises:
        ValueError: a knob out of range (all problems listed at once).

    Example::

        trainer = Trainer(max_steps=100, callbacks=[GRPOCheckpoint(every_n_loop_steps=10, keep_last=3)])
        trainer.fit(GRPOModule(), datamodule=PromptDataModule())  # killed at loop step 57: 50 is the newest
        trainer = Trainer(max_steps=100, callbacks=[GRPOCheckpoint(every_n_loop_steps=10, keep_last=3)])
        trainer.fit(GRPOModule(), datamodule=PromptDataModule(), ckpt_path=resolve_ckpt_path("last", trainer))
    """

    def __init__(self, dirpath: str | None = None, every_n_loop_steps: int = 10, keep_last: int = 2,
                 save_on_train_end: bool = True) -> None:
        problems = []
        if not isinstance(every_n_loop_steps, int) or every_n_loop_steps < 0:
            problems.append(f"every_n_loop_steps={every_n_loop_steps!r}: must be an integer >= 0 (0 = no schedule)")
        if not isinstance(keep_last, int) or keep_last < 0:
            problems.append(f"keep_last={keep_last!r}: must be an integer >= 0 (0 = keep every checkpoint)")
        if problems:
            raise ValueError("GRPOCheckpoint(" + "; ".join(problems) + ")")
        self.every_n_loop_steps, self.keep_last = every_n_loop_steps, keep_last
        self.save_on_train_end = save_on_train_end
        self.explicit_dirpath = dirpath is not None
        """Whether ``dirpath`` was given (then ``--ckpt_path last`` searches only there)."""
        self.dirpath: Path | None = Path(dirpath) if dirpath else None
        self._last_saved: int | None = None
        self.last_path: Path | None = None
        """The newest checkpoint this callback wrote."""

    # -- hooks -------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # a custom IO is the user's choice
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if not self.explicit_dirpath:
            self.dirpath = Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.ckpt_path is None and trainer.is_global_zero and complete_checkpoints(self.dirpath):
            log.warning("%s already holds checkpoints of another run; they are pruned and overwritten by this one "
                        "(resume with --ckpt_path last to continue them)", self.dirpath)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = _loop_step(pl_module)
        if self.every_n_loop_steps and step % self.every_n_loop_steps == 0:
            self.save(trainer, step)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = _loop_step(pl_module)
        if self.save_on_train_end and step > 0 and step != self._last_saved:
            self.save(trainer, step)

    # -- saving ------------------------------------------------------------------------------------------------------
    def save(self, trainer: Trainer, loop_step: int) -> Path:
        """Config beside it first, then the checkpoint under a staging name renamed into place, then prune.

        The staging rename covers strategies that bypass ``CheckpointIO`` too (FSDP2's sharded
        folder): a checkpoint name only ever points at a finished save, file or folder.
        """
        path = self.dirpath / checkpoint_name(loop_step)
        staging = staging_path(path)
        if trainer.is_global_zero:
            text = resolved_config(trainer).encode()
            atomic_write(config_path(path), lambda f: f.write(text))
        try:
            trainer.save_checkpoint(staging, weights_only=False)  # every rank (collectives), then a barrier
        except BaseException:
            if trainer.is_global_zero and not path.exists():
                config_path(path).unlink(missing_ok=True)  # no checkpoint, no config beside it
            raise
        if trainer.is_global_zero:
            publish(staging, path)
        self._last_saved, self.last_path = loop_step, path
        if trainer.is_global_zero:
            prune(self.dirpath, self.keep_last)
        return path


def _loop_step(module: LightningModule) -> int:
    step = getattr(module, "loop_step", None)
    if not isinstance(step, int):
        raise TypeError(f"GRPOCheckpoint counts loop steps through module.loop_step, which {type(module).__name__} "
                        "lacks (use it with GRPOModule)")
    return step


def resolved_config(trainer: Trainer) -> str:
    """The run's full config as YAML: LightningCLI's parsed config, else the module's config dataclasses."""
    from lightning.pytorch.cli import SaveConfigCallback

    for cb in trainer.callbacks:
        if isinstance(cb, SaveConfigCallback):
            return cb.parser.dump(cb.config, skip_none=False)
    import yaml

    module, out = trainer.lightning_module, {}
    for name in ("policy_cfg", "rl", "optim_cfg", "rollout_cfg", "seed"):
        value = getattr(module, name, None)
        out[name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return yaml.safe_dump({"model": out, "trainer": {"max_steps": trainer.max_steps}}, sort_keys=False)
