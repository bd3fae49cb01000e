"""``lightning-grpo plot``: the PNG is drawn from the logged values; the quickstart summary says where it is."""

from __future__ import annotations

import csv
import math
import os
import sys

import pytest

from lightning_grpo.cli import main as cli_main
from lightning_grpo.plot import PANELS, PlotError, find_metrics, plot_curves, read_series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _column(csv_path, key: str) -> tuple[list[float], list[float]]:
    """(step, value) of the rows of ``csv_path`` that logged ``key``: read independently of plot.py."""
    with open(csv_path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get(key)]
    return [float(r["step"]) for r in rows], [float(r[key]) for r in rows]


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


@pytest.mark.slow
def test_plot_of_a_quickstart_run_draws_the_logged_values(quickstart_run, tmp_path):
    csv_path = quickstart_run.log_dir / "metrics.csv"
    png, fig = plot_curves(csv_path, tmp_path / "curves.png")
    assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 10_000
    assert len(fig.axes) == 4
    for ax, (metric, _) in zip(fig.axes, PANELS):
        steps, values = _column(csv_path, metric)
        assert steps == [1.0, 2.0], metric  # one point per loop step
        line = ax.get_lines()[0]
        assert _same(list(line.get_xdata()), steps) and _same(list(line.get_ydata()), values), metric
    # validation ran after each loop step: the held-out greedy reward is the reward panel's second line
    val = fig.axes[0].get_lines()[1]
    assert _same(list(val.get_ydata()), _column(csv_path, "val/reward")[1]) and list(val.get_xdata()) == [1.0, 2.0]


@pytest.mark.slow
def test_quickstart_summary_says_where_the_curves_are(quickstart_run):
    line = next(ln for ln in quickstart_run.stdout.splitlines() if ln.strip().startswith("curves"))
    png = quickstart_run.log_dir / "curves.png"
    assert "curves.png" in line and "lightning-grpo plot" in line
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_plot_command_writes_beside_the_csv_or_where_asked(tmp_path, capsys):
    run = tmp_path / "runs" / "x" / "version_0"
    _write_csv(run / "metrics.csv")
    cli_main(["plot", str(tmp_path / "runs")])  # a folder of runs: the newest metrics.csv
    assert capsys.readouterr().out.strip() == str(run / "curves.png")
    assert (run / "curves.png").read_bytes().startswith(PNG_MAGIC)
    cli_main(["plot", str(run), "-o", str(tmp_path / "elsewhere.png")])
    assert (tmp_path / "elsewhere.png").stat().st_size > 0


def test_missing_panels_and_validation_rows(tmp_path):
    csv_path = tmp_path / "metrics.csv"
    _write_csv(csv_path, with_clip=False)
    series = read_series(csv_path)
    assert series["val/reward"] == ([2.0], [0.5])  # validation rows carry only their own columns
    assert series["reward/mean"] == ([1.0, 2.0], [0.1, 0.3])
    _, fig = plot_curves(csv_path)
    assert fig.axes[2].get_lines() == [] and "not logged" in fig.axes[2].texts[0].get_text()


def test_no_metrics_csv_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(PlotError, match="no metrics.csv"):
        find_metrics(tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli_main(["plot", str(tmp_path)])
    assert stop.value.code == 2 and "CSVLogger" in capsys.readouterr().err


def test_without_matplotlib_the_error_names_the_extra(tmp_path, monkeypatch):
    _write_csv(tmp_path / "metrics.csv")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    with pytest.raises(PlotError, match=r"pip install 'lightning-grpo\[plot\]'"):
        plot_curves(tmp_path / "metrics.csv")


def _write_csv(path, with_clip: bool = True) -> None:
    """A CSVLogger-shaped log: two loop-step rows and one validation row."""
    os.makedirs(path.parent, exist_ok=True)
    keys = ["step", "reward/mean", "grpo/loss", "completion/len_mean", "val/reward"] + ["grpo/clip_frac"] * with_clip
    rows = [
        {"step": 1, "reward/mean": 0.1, "grpo/loss": 0.01, "completion/len_mean": 3.0, "grpo/clip_frac": 0.0},
        {"step": 2, "reward/mean": 0.3, "grpo/loss": -0.02, "completion/len_mean": 2.5, "grpo/clip_frac": 0.1},
        {"step": 2, "val/reward": 0.5},
    ]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
