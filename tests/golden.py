"""Golden metric rows of the shortened quickstart (torchtune's "expected loss values"): a behaviour change fails fast,
with a diff that names the step and the column.

The expected rows live in ``tests/data/quickstart_golden.csv``: every non-timing column of the quickstart_run
fixture's metrics.csv (``timing.is_timing`` names the wall-clock ones). Rewrite them only on purpose, when a change is
meant to move the numbers (say why in the commit)::

    PYTHONPATH=. .venv/bin/python tests/golden.py

It runs the same shortened quickstart the fixture runs (``helpers.QUICKSTART_ARGS``, in-process) and writes the file.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
import sys
import tempfile
from pathlib import Path

GOLDEN = Path(__file__).parent / "data" / "quickstart_golden.csv"
RTOL = 1e-4
"""Relative tolerance per value: room for another CPU's float32 kernels (1 and 2 threads here wrote identical rows);
a changed divisor, seed stream or reward moves a value by far more."""
ATOL = 1e-7
"""Absolute floor, for values that are 0 in one run and float32 noise (~1e-8) in the other."""


def comparable_rows(csv_path: Path) -> list[dict[str, str]]:
    """metrics.csv's rows without the timing columns, values as written (empty = not logged on that row)."""
    from lightning_grpo.timing import is_timing

    with open(csv_path, newline="") as f:
        return [{k: v for k, v in row.items() if not is_timing(k)} for row in csv.DictReader(f)]


def _close(expected: str, got: str) -> bool:
    if expected == got:
        return True
    try:
        a, b = float(expected), float(got)
    except ValueError:  # an empty cell against a value, or text
        return False
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= ATOL + RTOL * abs(a)


def _label(row: dict[str, str], index: int) -> str:
    step = row.get("step", "")
    kind = "validation" if not row.get("reward/mean") else "training"
    return f"row {index} (step {step}, {kind})"


def diff(expected: list[dict[str, str]], got: list[dict[str, str]]) -> list[str]:
    """One readable line per difference: a missing or extra column, a missing or extra row, a value out of rtol."""
    lines = []
    want_cols = set(expected[0]) if expected else set()
    got_cols = set(got[0]) if got else set()
    lines += [f"column {c!r}: expected, not logged" for c in sorted(want_cols - got_cols)]
    lines += [f"column {c!r}: logged, not in the golden file" for c in sorted(got_cols - want_cols)]
    if len(expected) != len(got):
        lines.append(f"{len(got)} rows logged, {len(expected)} expected")
    for index, (want, have) in enumerate(zip(expected, got)):
        for column in sorted(want_cols & got_cols):
            if not _close(want[column], have[column]):
                lines.append(f"{_label(want, index)}, {column}: expected {want[column] or '(empty)'}, "
                             f"got {have[column] or '(empty)'}")
    return lines


def report(lines: list[str]) -> str:
    return (f"{len(lines)} difference(s) from {GOLDEN.name} (rtol {RTOL}, atol {ATOL}); if the change is meant to "
            "move these numbers, regenerate: PYTHONPATH=. python tests/golden.py\n  " + "\n  ".join(lines))


def write_golden() -> Path:
    """Run the shortened quickstart in a temporary folder and write its comparable rows to ``GOLDEN``."""
    old = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="lightning-grpo-golden-") as cwd:
        # as tests/conftest.py sets them: no network, no user cache (the warm start is computed afresh)
        os.environ.update(HF_HOME=f"{cwd}/hf", HF_HUB_OFFLINE="1", LIGHTNING_GRPO_CACHE=f"{cwd}/cache")
        os.environ.setdefault("WANDB_MODE", "offline")
        sys.path.insert(0, str(Path(__file__).parent))
        from helpers import QUICKSTART_ARGS

        from lightning_grpo.cli import main

        os.chdir(cwd)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                main(["fit", *QUICKSTART_ARGS])
        finally:
            os.chdir(old)
        rows = comparable_rows(Path(cwd) / "runs" / "quickstart" / "version_0" / "metrics.csv")
    with open(GOLDEN, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return GOLDEN


if __name__ == "__main__":
    print(f"wrote {write_golden()}")
