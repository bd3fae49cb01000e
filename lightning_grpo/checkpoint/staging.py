"""A save in two halves: written under a staging name (every rank), then published by rank 0.

The staging rename covers strategies that bypass ``CheckpointIO`` too (FSDP2's sharded folder): a
checkpoint name only ever points at a finished save, file or folder, whose manifest is already there.
``GRPOCheckpoint`` publishes once Lightning has written the loop step's metrics row.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from lightning.pytorch import Trainer

from lightning_grpo.checkpoint.atomic import DISK_FULL, disk_full
from lightning_grpo.checkpoint.beside import remove_beside, write_beside
from lightning_grpo.checkpoint.checkpoint_io import save_digest
from lightning_grpo.checkpoint.integrity import Manifest, write_manifest
from lightning_grpo.checkpoint.paths import (
    find_last_checkpoint,
    prune,
    publish,
    staging_path,
)
from lightning_grpo.checkpoint.state import NonFiniteParametersError

log = logging.getLogger(__name__)


def stage(
    trainer: Trainer,
    path: Path,
    *,
    lineage: str,
    run: str,
    loop_step: int,
    reason: str,
    parent: str | None,
) -> Manifest | None:
    """Config beside ``path`` first, then every rank saves under the staging name; rank 0 returns the manifest to
    publish with it. A failed save leaves nothing beside ``path``; a full disk names ``path``, not its staging name;
    a refusal of NaN/inf parameters (``NonFiniteParametersError``) names the checkpoint to fall back on."""
    if trainer.is_global_zero:
        write_beside(trainer, path)
    try:
        return _save(trainer, path, lineage, run, loop_step, reason, parent)
    except BaseException as err:
        if trainer.is_global_zero and not path.exists():
            # no checkpoint, no config or adapter beside it
            remove_beside(path)
        if isinstance(err, NonFiniteParametersError):
            _log_not_saved(loop_step, err, lineage, path.parent)
        if isinstance(err, OSError) and err.errno in DISK_FULL:
            # the last line names the checkpoint, not its staging name
            raise disk_full(err, path) from err
        raise


def _save(
    trainer: Trainer,
    path: Path,
    lineage: str,
    run: str,
    loop_step: int,
    reason: str,
    parent: str | None,
) -> Manifest | None:
    staging = staging_path(path)
    # Every rank (collectives), then a barrier. The module refuses NaN/inf parameters: checked there, inside
    # the hand-off's window, where parameters are resident (torch_memory_saver may have paused them before).
    trainer.save_checkpoint(staging, weights_only=False)
    if not trainer.is_global_zero:
        return None
    sha, size = save_digest(trainer.strategy.checkpoint_io, staging)
    return Manifest(
        lineage=lineage,
        run=run,
        loop_step=loop_step,
        global_step=trainer.global_step,
        saved_at=time.time_ns(),
        sha256=sha,
        bytes=size,
        reason=reason,
        parent=parent,
    )


def _log_not_saved(
    loop_step: int, err: NonFiniteParametersError, lineage: str, folder: Path
) -> None:
    log.error(
        "not saving loop step %d: parameter %r holds NaN/inf; the newest checkpoint of run %s, %s, "
        "holds the last good batch boundary",
        loop_step,
        err.parameter,
        lineage,
        find_last_checkpoint([folder], lineage),
    )


def publish_staged(
    path: Path, manifest: Manifest, validation: str | None, keep_last: int
) -> None:
    """Manifest, rename into place, prune the lineage's older files: the staged save becomes a checkpoint."""
    write_manifest(path, dataclasses.replace(manifest, validation=validation))
    publish(staging_path(path), path)
    prune(path.parent, keep_last, manifest.lineage)
