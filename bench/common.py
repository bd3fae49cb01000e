"""Shared bench plumbing: run one measurement per fresh subprocess, write JSON + PNG."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

# LIGHTNING_GRPO_BENCH_RESULTS: write elsewhere (the smoke test does, so it never touches the committed results).
RESULTS = Path(os.environ.get("LIGHTNING_GRPO_BENCH_RESULTS") or Path(__file__).parent / "results")


BENCH_VENV = Path(__file__).parent.parent / ".venv-bench"
"""The bench-only venv holding the peers (TRL), built by ``make bench-env``; the main venv never gets them."""


def run_child(module: str, *args: str, env: dict | None = None) -> dict:
    """Run ``python -m module args`` in a fresh process (clean peak RSS) and parse its last JSON line."""
    out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, check=False, env=env)
    if out.returncode:
        raise RuntimeError(f"{module} {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_env_python() -> str | None:
    """The bench venv's interpreter, or None when ``make bench-env`` has not been run."""
    py = BENCH_VENV / "bin" / "python"
    return str(py) if py.exists() else None


def clocks() -> tuple[float, float]:
    """(wall, process CPU) seconds. On a shared machine CPU time tracks the work done; wall time tracks the load."""
    import time

    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = clocks()
    return wall - start[0], cpu - start[1]


def load_average() -> float:
    """The 1-minute load average: the machine is shared, so every result records how busy it was."""
    return os.getloadavg()[0]


def cpu_model() -> str:
    """The CPU's model name, with family/model/stepping (a VM may report only "AMD EPYC")."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first CPU's block is enough
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    if "model name" not in info:
        return platform.processor() or platform.machine()
    ids = ", ".join(f"{k} {info[k]}" for k in ("cpu family", "model", "stepping") if k in info)
    return f"{info['model name']} ({ids})" if ids else info["model name"]


def machine() -> dict:
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "memory_gib": round(mem, 1),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path


def table(rows: list[dict], cols: list[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths)), "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(_fmt(r[c]).ljust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib (the ``plot`` extra) is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
"""The CPU flags that decide the GEMM kernels (float32 and bfloat16) torch picks."""


def cpu_flags() -> dict:
    """The SIMD flags of this CPU that matter for matmul speed (present / absent), from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    return {flag: flag in flags for flag in SIMD_FLAGS}
