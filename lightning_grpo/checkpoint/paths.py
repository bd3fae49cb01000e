"""Checkpoint files on disk: their names, which are complete, where ``last`` looks, and pruning.

Every rule about which files a run reads or deletes lives here, so ownership rules (which run
wrote a file) have one place to go. A name only ever points at a finished save: torn writes and
staging saves start with a dot and never match ``loop-step-<N>.ckpt``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from lightning.pytorch import Trainer

from lightning_grpo.checkpoint.atomic import fsync_dir

log = logging.getLogger(__name__)

_NAME = re.compile(r"^loop-step-(\d+)\.ckpt$")


def checkpoint_name(loop_step: int) -> str:
    return f"loop-step-{loop_step:06d}.ckpt"


def staging_path(path: Path) -> Path:
    """Where a save of ``path`` is written before it is renamed into place (never matches a checkpoint name)."""
    return path.with_name(f".{path.name}.staging")


def config_path(ckpt: Path) -> Path:
    """The resolved config saved beside ``ckpt`` (``loop-step-000004.config.yaml``)."""
    return ckpt.with_name(ckpt.stem + ".config.yaml")


def publish(staging: Path, path: Path) -> None:
    """Rename a finished save (file or sharded folder) into place; the same loop step saved again replaces it."""
    if path.is_dir():
        shutil.rmtree(path)  # a folder cannot be renamed over
    os.replace(staging, path)
    fsync_dir(path.parent)


def complete_checkpoints(dirpath: str | os.PathLike | None) -> list[Path]:
    """Complete checkpoints (files, or sharded folders) in ``dirpath``, oldest loop step first."""
    if dirpath is None or not Path(dirpath).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(dirpath).iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def prune(dirpath: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints of ``dirpath`` (and their configs)."""
    old = complete_checkpoints(dirpath)[:-keep_last] if keep_last else []
    for path in old:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        config_path(path).unlink(missing_ok=True)
    return old


def find_last_checkpoint(dirs: list[str | os.PathLike]) -> Path | None:
    """Newest complete checkpoint (modification time, then loop step) in ``dirs``."""
    found = [p for d in dirs for p in complete_checkpoints(d)]
    return max(found, key=lambda p: (p.stat().st_mtime_ns, int(_NAME.match(p.name).group(1))), default=None)


def search_dirs(trainer: Trainer) -> list[Path]:
    """Where ``last`` looks: each GRPOCheckpoint's explicit dirpath, else ``checkpoints/`` of every run version."""
    from lightning_grpo.checkpoint.callback import GRPOCheckpoint

    explicit = [cb.dirpath for cb in trainer.callbacks if isinstance(cb, GRPOCheckpoint) and cb.explicit_dirpath]
    if explicit:
        return explicit
    logger = trainer.logger
    root = Path(getattr(logger, "root_dir", None) or trainer.default_root_dir)
    return [root / "checkpoints", *sorted(root.glob("*/checkpoints"))]


def resolve_ckpt_path(ckpt_path: str | os.PathLike | None, trainer: Trainer) -> str | os.PathLike | None:
    """``"last"`` -> the newest complete checkpoint (None, with a warning, when there is none); else unchanged."""
    if ckpt_path != "last":
        return ckpt_path
    dirs = search_dirs(trainer)
    found = find_last_checkpoint(dirs)
    if found is None:  # like Lightning: "last" may be set before the first run of a job
        log.warning("ckpt_path='last': no complete checkpoint under %s; starting from scratch",
                    ", ".join(str(d) for d in dirs))
        return None
    log.info("ckpt_path='last' resolved to %s", found)
    return str(found)
