"""Shared bench plumbing: run one measurement per fresh subprocess, write JSON + PNG."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def run_child(module: str, *args: str) -> dict:
    """Run ``python -m module args`` in a fresh process (clean peak RSS) and parse its last JSON line."""
    out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{module} {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine() -> dict:
    import os

    import torch

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version()}


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
