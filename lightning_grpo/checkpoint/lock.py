"""One live run per checkpoint folder: ``<dirpath>/.lock``, held with ``flock`` while the run trains.

Two live runs writing one folder would each prune and resume the other's files. The lock is an
exclusive ``flock`` on a file that names its holder (pid, host, run id, start time): the kernel
drops it when the holder dies, even under ``kill -9``, so a stale lock never blocks a resume, and
the next holder says whose lock it took over. On a filesystem without ``flock`` (some network
mounts) the holder's pid is checked instead when it ran on this host; a lock from another host
that cannot be checked is taken over with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_grpo.checkpoint.paths import entries

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"


class FolderInUseError(RuntimeError):
    """Another live run holds the checkpoint folder."""


class FolderLock:
    """Exclusive hold on a checkpoint folder for one run (``acquire`` at train start, ``release`` at its end).

    Args:
        folder: the checkpoint folder (created if missing).
    """

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, run: str, lineage: str) -> None:
        """Hold the folder for ``run``; raises ``FolderInUseError`` naming the live holder."""
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            previous = _holder(fd)
            if not _flock(fd, previous):
                raise FolderInUseError(
                    f"checkpoint folder {self.path.parent} is in use by another live run ({_describe(previous)}): "
                    "two runs writing one folder would prune and resume each other's checkpoints. Give this run "
                    "its own --checkpoint.dirpath, or stop the other run first"
                )
            if previous and previous.get("pid") != os.getpid():
                log.info(
                    "checkpoint folder %s: took over the lock of a run that is gone (%s)",
                    self.path.parent,
                    _describe(previous),
                )
            me = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "run": run,
                "lineage": lineage,
                "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Drop the hold (the file stays: unlinking a locked file lets two runs lock two different files)."""
        if self._fd is None:
            return
        fd = self._fd
        self._fd = None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing drops the flock


def take_folder(
    trainer: Trainer, lock: FolderLock | None, run: str, lineage: str
) -> None:
    """Hold ``lock`` (rank 0's; None on the other ranks) for this run: every rank raises ``FolderInUseError`` if
    another live run holds the folder. Rank 0 says when the folder also holds other runs' checkpoints."""
    refused = None
    if lock is not None:
        folder = lock.path.parent
        try:
            lock.acquire(run, lineage)
        except FolderInUseError as err:
            refused = str(err)
        others = sorted({e.lineage or "(no id)" for e in entries([folder])} - {lineage})
        if refused is None and others:
            rank_zero_info(
                f"{folder} also holds checkpoints of run(s) {', '.join(others)}: this run "
                f"({lineage}) prunes only its own; --ckpt_path last resumes the run saved last"
            )
    refused = trainer.strategy.broadcast(refused)
    if refused:
        raise FolderInUseError(refused)


def _flock(fd: int, previous: dict | None) -> bool:
    """Take the lock; False when a live run holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EINVAL, errno.ENOTSUP, errno.ENOSYS):
            raise
    # No flock on this filesystem: judge the recorded holder.
    if not previous or previous.get("pid") == os.getpid():
        return True
    if previous.get("host") == socket.gethostname():
        return not _alive(int(previous.get("pid", 0)))
    log.warning(
        "checkpoint folder lock %s: this filesystem has no flock and the holder (%s) ran on another host; "
        "taking the folder over",
        previous,
        _describe(previous),
    )
    return True


def _holder(fd: int) -> dict | None:
    try:
        text = os.pread(fd, 4096, 0).decode()
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None


def _describe(holder: dict | None) -> str:
    if not holder:
        return "holder unknown"
    return (
        f"run {holder.get('run')} of lineage {holder.get('lineage')}, pid {holder.get('pid')} on host "
        f"{holder.get('host')}, since {holder.get('since')}"
    )


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
