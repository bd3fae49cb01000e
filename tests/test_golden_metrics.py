"""The quickstart's first loop steps log the golden metric rows (tests/data/quickstart_golden.csv, tests/golden.py).

A behaviour change (a divisor, a seed stream, a reward, a metric's name) fails here with one line per value that moved,
naming the step and the column; timing columns are left out (they differ run to run).
"""

from __future__ import annotations

import csv

from golden import ATOL, GOLDEN, RTOL, comparable_rows, diff, report


def _golden() -> list[dict[str, str]]:
    with open(GOLDEN, newline="") as f:
        return list(csv.DictReader(f))


def test_the_quickstarts_first_loop_steps_log_the_golden_rows(quickstart_run):
    got = comparable_rows(quickstart_run.log_dir / "metrics.csv")
    lines = diff(_golden(), got)
    assert not lines, report(lines)


def test_the_golden_rows_hold_training_and_validation_values_and_no_timing():
    rows = _golden()
    assert [r["step"] for r in rows if r["reward/mean"]] == ["1", "2"]  # the two shortened loop steps
    assert any(r["val/reward"] for r in rows) and not any(c.startswith("time/") for c in rows[0])


def test_the_diff_names_the_row_and_column_of_a_value_out_of_tolerance_only():
    rows = [{"step": "1", "reward/mean": "0.5", "loss": "0.25"}, {"step": "1", "reward/mean": "", "val/reward": "0.7"}]
    rows[1]["loss"] = ""
    moved = [dict(r) for r in rows]
    moved[0]["loss"] = repr(0.25 * (1 + 3 * RTOL))  # a control: just out of tolerance
    assert diff(rows, moved) == [f"row 0 (step 1, training), loss: expected 0.25, got {moved[0]['loss']}"]
    within = [dict(r) for r in rows]
    within[0]["loss"] = repr(0.25 * (1 + RTOL / 2))
    assert diff(rows, within) == []
    within[0]["loss"] = repr(0.25 + ATOL / 2 + RTOL * 0.25)
    assert diff(rows, within) == []


def test_the_diff_names_missing_values_columns_and_rows():
    rows = [{"step": "1", "reward/mean": "0.5", "loss": "0.25"}]
    renamed = [{"step": "1", "reward/mean": "0.5", "grpo/loss": "0.25"}]
    assert diff(rows, renamed) == ["column 'loss': expected, not logged",
                                   "column 'grpo/loss': logged, not in the golden file"]
    assert diff(rows, [{**rows[0], "loss": ""}]) == ["row 0 (step 1, training), loss: expected 0.25, got (empty)"]
    assert diff(rows, rows * 2) == ["2 rows logged, 1 expected"]
