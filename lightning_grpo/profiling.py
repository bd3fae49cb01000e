"""Loop profile records: one JSONL line per loop step, wall time per phase and memory at every phase boundary.

Turned on by ``LIGHTNING_GRPO_PROFILE_LOOP=1`` (or ``HandoffCallback(profile=True)``). The
hand-off Callback calls ``boundary(name)`` at every transition of its phase machine: the
phase that was running ends there (its wall time is recorded with the memory sampled at
that instant) and phase ``name`` starts. ``write`` appends the step's record and starts
the next one. On CUDA every boundary synchronizes the device so phase times are real
(a cost paid only while profiling); memory is ``torch.cuda`` allocated/reserved plus the
whole card's use from the driver (engines allocate outside PyTorch's allocator). On CPU it
is the process's resident set size.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import torch

ENV = "LIGHTNING_GRPO_PROFILE_LOOP"


def profiling_requested() -> bool:
    """Whether the environment asks for loop profile records."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def memory_sample(device: torch.device) -> dict[str, int]:
    """Memory now: CUDA allocated/reserved/used-on-card bytes on a GPU, process RSS bytes on CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {
            "cuda_allocated": torch.cuda.memory_allocated(device),
            "cuda_reserved": torch.cuda.memory_reserved(device),
            "device_used": total - free,
        }
    return {"rss": rss_bytes()}


def rss_bytes() -> int:
    """Current resident set size (Linux ``/proc``); elsewhere the peak from ``getrusage``."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class LoopProfile:
    """Collects the phases of one loop step and appends them to ``path`` as one JSON line.

    Args:
        path: the JSONL file; None = disabled (every call is a no-op).
        device: whose memory to sample.
    """

    def __init__(self, path: str | os.PathLike | None, device: torch.device | str = "cpu") -> None:
        self.path = Path(path) if path is not None else None
        self.device = torch.device(device)
        self._phases: list[dict] = []
        self._current: tuple[str, float] | None = None
        self._start_memory: dict[str, int] | None = None
        self.last: dict | None = None
        """The last record written (tests and callers read it without parsing the file)."""

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def boundary(self, name: str | None) -> None:
        """End the running phase here (time + memory) and start ``name`` (None = nothing runs next)."""
        if not self.enabled:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now, memory = time.perf_counter(), memory_sample(self.device)
        if self._current is not None:
            phase, start = self._current
            self._phases.append({"phase": phase, "seconds": now - start, "memory_end": memory})
        elif self._start_memory is None:
            self._start_memory = memory
        self._current = (name, now) if name is not None else None

    def write(self, **fields) -> None:
        """Close the running phase and append one record: ``fields``, phases, per-phase seconds, memory."""
        if not self.enabled:
            return
        self.boundary(None)
        seconds: dict[str, float] = {}
        for p in self._phases:
            seconds[p["phase"]] = seconds.get(p["phase"], 0.0) + p["seconds"]
        record = {**fields, "seconds": seconds, "total_seconds": sum(seconds.values()),
                  "memory_start": self._start_memory, "phases": self._phases}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.last, self._phases, self._start_memory = record, [], None
