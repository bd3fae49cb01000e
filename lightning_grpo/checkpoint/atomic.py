"""Atomic files: a crash mid-write leaves the previous file intact.

- ``atomic_write`` writes to a temp file in the same folder, fsyncs it, ``os.replace``s it over
  the name and fsyncs the folder: the name only ever points at a finished file. It hashes what it
  writes as it writes it.
- The bottom of ``checkpoint/``: it imports nothing of ours, so ``integrity.py`` (manifests),
  ``paths.py`` (publish) and ``checkpoint_io.py`` (``AtomicCheckpointIO``) all build on it.
- A full disk ends in ``OSError: [Errno 28] No space left on device: '<path>'``: torch's zip writer
  swallows the ``OSError`` of a failed write and raises its own ``unexpected pos`` error instead, so the
  writer keeps the first ``OSError`` and raises that, naming the file.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def atomic_write(
    path: str | os.PathLike, write: Callable[[IO[bytes]], None]
) -> tuple[str, int]:
    """``write(f)`` into a temp file beside ``path``, fsync, then rename over ``path`` (all or nothing).

    Returns the SHA-256 and size of what was written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # same folder: the rename never crosses a filesystem
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
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
        cause = (
            err if isinstance(err, OSError) else out.error if out is not None else None
        )
        if isinstance(cause, OSError) and cause.errno in DISK_FULL:
            raise disk_full(cause, path) from err
        raise
    fsync_dir(path.parent)
    return out.sha.hexdigest(), out.bytes


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> tuple[str, int]:
    """``atomic_write`` of ``data`` as is (a config, a manifest)."""

    def write(f: IO[bytes]) -> None:
        f.write(data)

    return atomic_write(path, write)


def disk_full(err: OSError, path: Path) -> OSError:
    """``OSError: [Errno 28] No space left on device: '<path>'``: the errno's own words and the file."""
    return OSError(err.errno, os.strerror(err.errno), str(path))


class _Recording:
    """The file handed to a writer: hashes what passes through, and keeps an ``OSError`` a writer may swallow."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.bytes = 0
        self.error = None

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
