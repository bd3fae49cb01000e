"""What a test run leaves behind: ``/dev/shm`` entries (RAM until reboot) and temporary folders nobody holds.

``tests/conftest.py`` snapshots both places when the session starts and, when it ends, lists the entries that
appeared meanwhile and that no live process holds; with LIGHTNING_GRPO_LEFTOVERS_FAIL=1 the run fails on them.
Other jobs may run on the same machine: an entry a live process maps, holds open, works in, or names in its command
line or environment is theirs (or still in use), never a leftover; nor is a folder this process will remove at exit
(a live ``tempfile.TemporaryDirectory``, multiprocessing's own temporary folder, a ``sem.mp-*`` semaphore its
resource tracker unlinks at exit). A job that ended meanwhile on a shared machine can still show its own
leftovers here: hence a report by default, a failure on request (CI, once the slow tier leaves nothing).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
import tempfile
import warnings
from pathlib import Path

SHM = Path("/dev/shm")
CACHES = ("torchinductor_", "hsperfdata_")
"""Per-user caches in the temporary folder that tools keep on purpose (torch's compiled kernels): not leftovers."""


def roots() -> list[Path]:
    """The places watched: /dev/shm (where it exists) and the temporary folder."""
    return [p for p in (SHM, Path(tempfile.gettempdir())) if p.is_dir()]


def entries() -> set[str]:
    """Every entry directly under the watched places, as absolute paths."""
    found = set()
    for root in roots():
        try:
            found.update(str(p) for p in root.iterdir())
        except OSError:
            continue
    return found


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode(errors="replace").replace("\0", " ")
    except OSError:  # gone meanwhile, or not ours to read
        return ""


def held() -> set[str]:
    """Paths under the watched places that a live process maps, holds open, works in, or names in its command line
    or environment (Linux ``/proc``)."""
    places = "|".join(re.escape(str(r)) for r in roots())
    pattern = re.compile(rf"(?:{places})/[^\s:=;\"']+")
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        text = _read(proc / "maps") + " " + _read(proc / "cmdline") + " " + _read(proc / "environ")
        found.update(pattern.findall(text))
        try:
            found.add(os.readlink(proc / "cwd"))
            found.update(os.readlink(fd) for fd in (proc / "fd").iterdir())
        except OSError:
            continue
    return found


def _pending_tracker() -> bool:
    """Whether this session's multiprocessing resource tracker runs: at exit it unlinks the named semaphores
    (``sem.mp-*``) of children killed with -9 before they could (their SemLocks are registered with it)."""
    from multiprocessing import resource_tracker

    pid = resource_tracker._resource_tracker._pid
    return pid is not None and Path(f"/proc/{pid}").exists()


def _this_process_will_remove() -> set[str]:
    """Folders this process removes at exit: live ``tempfile.TemporaryDirectory`` objects, multiprocessing's own."""
    found = set()
    mp_temp = multiprocessing.current_process()._config.get("tempdir")
    if mp_temp:
        found.add(mp_temp)
    with warnings.catch_warnings():  # isinstance on every object touches deprecated module attributes
        warnings.simplefilter("ignore")
        found.update(str(obj.name) for obj in gc.get_objects()
                     if isinstance(obj, tempfile.TemporaryDirectory) and obj._finalizer.alive)
    return found


def _is_held(entry: str, holding: set[str]) -> bool:
    if Path(entry).name.startswith("sem.mp-") and _pending_tracker():
        return True
    return any(path == entry or path.startswith(entry + "/") for path in holding)


def leftovers(before: set[str], keep: set[str] = frozenset()) -> list[str]:
    """Entries that appeared since ``before``, that no live process holds, minus ``keep`` and the known caches."""
    new = [e for e in entries() - before - set(keep) if not Path(e).name.startswith(CACHES)]
    if not new:
        return []
    gc.collect()  # run the finalizers of objects nobody references any more (a closed engine's folders)
    holding = held() | _this_process_will_remove()
    return sorted(e for e in new if os.path.lexists(e) and not _is_held(e, holding))
