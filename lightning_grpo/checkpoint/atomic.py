"""Atomic files: a crash mid-save leaves the previous checkpoint intact, and loading never runs code.

- ``atomic_write`` writes to a temp file in the same folder, fsyncs it, ``os.replace``s it over
  the name and fsyncs the folder: the name only ever points at a finished file.
- ``AtomicCheckpointIO`` is Lightning's ``TorchCheckpointIO`` with that writer, and with
  ``torch.load(weights_only=True)`` whatever the caller asks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from typing_extensions import override

log = logging.getLogger(__name__)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """``write(f)`` into a temp file beside ``path``, fsync, then rename over ``path`` (all or nothing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # same folder: the rename never crosses a filesystem
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # data on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename inside ``folder`` survive a power cut."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with a same-folder temp file + ``os.replace``, and ``weights_only=True`` loads.

    Lightning's own ``_atomic_save`` stages through fsspec, which on a local disk writes the temp file
    under ``/tmp`` and moves it: across filesystems that move is a copy, so a crash can leave a torn file.
    Remote (``scheme://``) paths keep Lightning's behaviour.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        atomic_write(path, lambda f: torch.save(checkpoint, f))

    @override
    def load_checkpoint(self, path, map_location: Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if weights_only is False:
            log.warning("AtomicCheckpointIO loads with weights_only=True only (nothing in a checkpoint may run code)")
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)
