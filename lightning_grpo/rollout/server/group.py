"""A launched server's process group once it is told to stop: what shared memory it maps, and waiting for it to go.

vLLM's engine core and workers talk through multiprocessing queues in ``/dev/shm`` (``psm_*``, 160-240 MB
sparse each, and ``sem.mp-*`` semaphores). A process that exits cleanly unlinks them; one that is killed takes
its resource tracker (same process group) along, and they stay until reboot. ``ServerProcess.stop`` reads what
the group maps before signalling it (``group_shm``) and unlinks what is left once the group is gone.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

SHM_PREFIXES = ("psm_", "sem.mp-")
"""``/dev/shm`` entries of Python's multiprocessing (``SharedMemory``, semaphores), which vLLM's queues use."""


def group_shm(pgid: int) -> set[Path]:
    """The ``/dev/shm`` multiprocessing segments mapped by the processes of group ``pgid`` (Linux ``/proc``)."""
    found = set()
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # field 5: the group
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for line in (proc / "maps").read_text().splitlines():
                path = (
                    Path(line.split(maxsplit=5)[-1]) if line.count(" ") >= 5 else None
                )
                if (
                    path
                    and path.parent == Path("/dev/shm")
                    and path.name.startswith(SHM_PREFIXES)
                ):
                    found.add(path)
    return found


def wait_group(pgid: int, timeout: float) -> None:
    """Wait until no process of group ``pgid`` is left, at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)
