"""One timer per loop step: each phase named once, timed where it runs.

The parts that run a phase wrap it, as verl's ``marked_timer`` does::

    with timer.phase(UPDATE):
        result = updater.update(batch)

``columns()`` gives metrics.csv its ``time/<phase>`` columns (every name on every loop step, 0.0
for a phase that did not run) and starts the next step. Phases may nest (``ahead`` runs inside
``update``). On CUDA a phase's end waits for the device, so its time is the work's, not the
launch's: one synchronize per phase, where the step waits anyway (docs/metrics.md).

Profile records (``LIGHTNING_GRPO_PROFILE_LOOP=1`` or ``HandoffCallback(profile=True)``) are the
same timer writing more: every phase's end, sub-phases included, with the memory then, one JSON
line per loop step (``ProfileRecords``, docs/handoff.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import torch

WAIT_BATCH = "wait_batch"
"""The collector's batch: generation, or the wait for the batch drawn ahead, rewards and advantages included."""
SYNC = "sync"
"""The publication before the draw: weights to the engine (colocated: wake, sync, offload, wake)."""
AHEAD = "ahead"
"""The ahead pass of the update (frozen pi_old, records); 0.0 when none runs."""
UPDATE = "update"
"""The whole update: the ahead pass and every window of chunks."""
STEP = "step"
"""Wall time since the previous loop step's row (the first: since training started)."""
PHASES = (WAIT_BATCH, SYNC, AHEAD, UPDATE, STEP)
"""The phases metrics.csv has a column for, ``time/<phase>``."""
PREFIX = "time/"
ENV = "LIGHTNING_GRPO_PROFILE_LOOP"
"""Set to 1 to write profile records (``HandoffCallback(profile=...)`` overrides it)."""


def is_timing(name: str) -> bool:
    """Whether metric ``name`` is wall-clock timing (differs run to run)."""
    return name.startswith(PREFIX)


def profiling_requested() -> bool:
    """Whether the environment asks for profile records."""
    value = os.environ.get(ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


class StepTimer:
    """Wall time per phase of one loop step.

    Args:
        device: where the step's work runs; on CUDA a phase's end synchronizes it.

    Example::

        timer = StepTimer()
        with timer.phase(UPDATE):
            ...
        timer.columns()  # {"time/update": 0.8, ..., "time/step": 1.1}
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.records: ProfileRecords | None = None
        """Where every phase's end is also written (None: nowhere)."""
        self._seconds: dict[str, float] = {}
        self._step_start = time.perf_counter()

    def restart(self, device: torch.device | str | None = None) -> None:
        """Start a step now, nothing timed yet (training starts; the device may have moved)."""
        if device is not None:
            self.device = torch.device(device)
        self._seconds = {}
        self._step_start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (added up when it runs twice)."""
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds
        if self.records is not None:
            self.records.phase_end(name, seconds)

    def seconds(self, name: str) -> float:
        """The time phase ``name`` ran in this step so far."""
        return self._seconds.get(name, 0.0)

    def columns(self) -> dict[str, float]:
        """This step's ``time/<phase>`` columns; the next step starts now."""
        now = time.perf_counter()
        out = {}
        for name in PHASES:
            out[PREFIX + name] = self.seconds(name)
        out[PREFIX + STEP] = now - self._step_start
        self._seconds = {}
        self._step_start = now
        return out


class ProfileRecords:
    """A JSONL file: one line per loop step, every phase's end with the memory then.

    Args:
        path: the file (appended).
        device: whose memory to sample: CUDA allocated/reserved and the card's use on a GPU, the
            process's resident set on CPU.
    """

    def __init__(
        self, path: str | os.PathLike, device: torch.device | str = "cpu"
    ) -> None:
        self.path = Path(path)
        self.device = torch.device(device)
        self.last: dict | None = None
        """The last record written (callers read it without parsing the file)."""
        self._phases: list[dict] = []
        self._memory_start = memory_sample(self.device)
        self._start = time.perf_counter()

    def phase_end(self, name: str, seconds: float) -> None:
        memory = memory_sample(self.device)
        self._phases.append({"phase": name, "seconds": seconds, "memory_end": memory})

    def write(self, **fields) -> None:
        """Append this step's record (``fields``, per-phase seconds, memory) and start the next."""
        seconds: dict[str, float] = {}
        for p in self._phases:
            seconds[p["phase"]] = seconds.get(p["phase"], 0.0) + p["seconds"]
        now = time.perf_counter()
        record = {
            **fields,
            "seconds": seconds,
            "total_seconds": now - self._start,
            "memory_start": self._memory_start,
            "phases": self._phases,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.last = record
        self._phases = []
        self._memory_start = memory_sample(self.device)
        self._start = now


def memory_sample(device: torch.device) -> dict[str, int]:
    """Memory now: CUDA allocated/reserved/used-on-card bytes on a GPU, process RSS bytes on CPU."""
    if device.type != "cuda":
        return {"rss": rss_bytes()}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "cuda_allocated": torch.cuda.memory_allocated(device),
        "cuda_reserved": torch.cuda.memory_reserved(device),
        "device_used": total - free,
    }


def rss_bytes() -> int:
    """Current resident set size (Linux ``/proc``); elsewhere the peak from ``getrusage``."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
