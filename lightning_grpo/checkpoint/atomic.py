"""Atomic files: a crash mid-save leaves the previous checkpoint intact, and loading never runs code.

- ``atomic_write`` writes to a temp file in the same folder, fsyncs it, ``os.replace``s it over
  the name and fsyncs the folder: the name only ever points at a finished file.
- ``AtomicCheckpointIO`` is Lightning's ``TorchCheckpointIO`` with that writer, and with
  ``torch.load(weights_only=True)`` whatever the caller asks; it verifies a file against its manifest
  (``integrity.py``) before loading it, and hashes what it writes as it writes it.
- A full disk ends in ``OSError: [Errno 28] No space left on device: '<path>'``: torch's zip writer
  swallows the ``OSError`` of a failed write and raises its own ``unexpected pos`` error instead, so the
  writer keeps the first ``OSError`` and raises that, naming the file.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from typing_extensions import override

log = logging.getLogger(__name__)


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> tuple[str, int]:
    """``write(f)`` into a temp file beside ``path``, fsync, then rename over ``path`` (all or nothing).

    Returns the SHA-256 and size of what was written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # same folder: the rename never crosses a filesystem
    out: _Recording | None = None
    try:
        with open(tmp, "wb") as f:
            out = _Recording(f)
            write(out)
            f.flush()
            os.fsync(f.fileno())  # data on disk before the name points at it
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        cause = err if isinstance(err, OSError) else out.error if out is not None else None
        if isinstance(cause, OSError) and cause.errno in DISK_FULL:
            raise disk_full(cause, path) from err
        raise
    fsync_dir(path.parent)
    return out.sha.hexdigest(), out.bytes


def disk_full(err: OSError, path: Path) -> OSError:
    """``OSError: [Errno 28] No space left on device: '<path>'``: the errno's own words and the file."""
    return OSError(err.errno, os.strerror(err.errno), str(path))


class _Recording:
    """The file handed to a writer: hashes what passes through, and keeps an ``OSError`` a writer may swallow."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.sha, self.bytes, self.error = f, hashlib.sha256(), 0, None

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as err:
            self.error = self.error or err
            raise
        self.sha.update(data)
        self.bytes += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self.f.flush()


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

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, tuple[str, int]] = {}
        """SHA-256 and size of each file this IO wrote, by path (read by GRPOCheckpoint for the manifest)."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        self.written[str(path)] = atomic_write(path, lambda f: torch.save(checkpoint, f))

    @override
    def load_checkpoint(self, path, map_location: Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if weights_only is False:
            log.warning("AtomicCheckpointIO loads with weights_only=True only (nothing in a checkpoint may run code)")
        if "://" not in str(path) and Path(path).exists():  # a missing file: Lightning's own "not found" error
            from lightning_grpo.checkpoint.integrity import check_intact
            from lightning_grpo.checkpoint.paths import previous_checkpoint

            check_intact(Path(path), previous_checkpoint(Path(path)))
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)
