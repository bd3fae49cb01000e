"""Summary, metrics.csv and curves.png agree on a finished fit: used by every test that runs a shipped config
(tests/test_summary.py runs each shrunk; the as-shipped learning runs and the gsm8k recipe check their own runs)."""

from __future__ import annotations

import csv
import re
from pathlib import Path

from lightning_grpo.plot import REPLACED_BY, SMOOTHED, plot_curves
from lightning_grpo.summary import HEADLINES, VAL_HEADLINES

CONFIGS = Path(__file__).parents[1] / "configs"


def check_agreement(name: str, run: Path, summary: str, scratch: Path) -> None:
    """The summary's first/last figures and validations of config ``name``'s run folder ``run`` are its metrics.csv's,
    and the plot draws exactly those rows."""
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    drawn = plot_curves(run / "metrics.csv", scratch / "check.png").lines  # what curves.png holds
    assert (run / "curves.png").is_file()
    loop_steps = [float(r["step"]) for r in rows if r.get("loop_step")]
    assert f"loop steps       {loop_steps[-1]:.0f}  (" in summary
    checked = _train_agree(summary, rows, drawn) + _val_agree(summary, rows, drawn)
    expected = {"dpo-arith": {"dpo/loss", "val/accuracy"}}.get(name, {"reward/mean", "val/reward"})
    assert set(checked) == expected, summary
    if "num_sanity_val_steps: -1" in (CONFIGS / f"{name}.yaml").read_text():  # the starting weights, a CSV row too
        assert next(float(r["step"]) for r in rows if r.get("val/reward")) == 0.0


def _column(rows: list[dict], metric: str) -> tuple[list[float], list[float]]:
    kept = [r for r in rows if r.get(metric)]
    return [float(r["step"]) for r in kept], [float(r[metric]) for r in kept]


def _train_agree(summary: str, rows: list[dict], drawn: dict) -> list[str]:
    checked = []
    logged = {metric for metric in rows[0] if _column(rows, metric)[1]} if rows else set()
    for metric, label in HEADLINES.items():
        steps, values = _column(rows, metric)
        if not values or REPLACED_BY.get(metric) in logged:
            continue
        w = min(5, len(values))
        first = re.search(rf"  {re.escape(label)} first {w}\s+(\S+)  \(loop steps (\d+)-", summary)
        last = re.search(rf"  {re.escape(label)} last {w}\s+(\S+)  \(loop steps \d+-(\d+)", summary)
        assert first and last, (metric, summary)
        assert drawn[metric] == (steps, values)  # the plot draws the CSV's rows, no more, no fewer
        head, tail = sum(values[:w]) / w, sum(values[-w:]) / w
        assert abs(float(first.group(1)) - head) < 6e-4 and abs(float(last.group(1)) - tail) < 6e-4, metric
        assert float(first.group(2)) == steps[0] and float(last.group(2)) == steps[-1]
        if (smooth := SMOOTHED.format(metric=metric, window=5)) in drawn:  # the trailing mean ends on "last 5"
            assert abs(drawn[smooth][1][w - 1] - head) < 1e-12 and abs(drawn[smooth][1][-1] - tail) < 1e-12
        checked.append(metric)
    return checked


def _val_agree(summary: str, rows: list[dict], drawn: dict) -> list[str]:
    checked = []
    for metric in VAL_HEADLINES:
        steps, values = _column(rows, metric)
        if not values:
            continue
        first = re.search(rf"  {metric} first (\S+)  \(loop step (\d+)\)", summary)
        last = re.search(rf"  {metric} last  (\S+)  \(loop step (\d+), \S+; (\d+) validations\)", summary)
        assert first and last, (metric, summary)
        assert drawn[metric] == (steps, values)
        assert abs(float(first.group(1)) - values[0]) < 6e-4 and float(first.group(2)) == steps[0]
        assert abs(float(last.group(1)) - values[-1]) < 6e-4 and float(last.group(2)) == steps[-1]
        assert int(last.group(3)) == len(values)  # "9 validations" and 8 rows no more
        checked.append(metric)
    return checked
