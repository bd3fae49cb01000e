"""``lightning-grpo plot``: the PNG is drawn from the logged values; the quickstart summary says where it is."""

from __future__ import annotations

import csv
import math
import os
import sys

import pytest

from lightning_grpo.cli import main as cli_main
from lightning_grpo.plot import SMOOTHED, PlotError, find_metrics, panels_of, plot_curves, read_series

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
    curves = plot_curves(csv_path, tmp_path / "curves.png")
    png, fig = curves.png, curves.figure
    assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 10_000
    panels = [p.metric for p in panels_of(read_series(csv_path))]
    # n_mini = 1 and beta = 0: no clip panel (exactly 0) and no KL panel (not moving)
    assert panels == ["reward/mean", "grpo/loss", "completion/len_mean"]
    for ax, metric in zip(fig.axes, panels):
        steps, values = _column(csv_path, metric)
        assert steps == [1.0, 2.0], metric  # one point per loop step
        line = ax.get_lines()[0]
        assert _same(list(line.get_xdata()), steps) and _same(list(line.get_ydata()), values), metric
        assert curves.lines[metric] == (steps, values)
    # validation ran before training (every held-out prompt: num_sanity_val_steps -1) and after each loop step
    val = fig.axes[0].get_lines()[2]
    assert _same(list(val.get_ydata()), _column(csv_path, "val/reward")[1]) and list(val.get_xdata()) == [0.0, 1.0, 2.0]


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


def test_panels_follow_what_the_run_logged(tmp_path):
    """The clip panel was flat 0 whenever n_mini = 1, and a KL that reached 0.2 had no panel."""
    csv_path = tmp_path / "metrics.csv"
    _write_csv(csv_path, with_clip=False)
    series = read_series(csv_path)
    assert series["val/reward"] == ([2.0], [0.5])  # validation rows carry only their own columns
    assert series["reward/mean"] == ([1.0, 2.0], [0.1, 0.3])
    assert [p.metric for p in panels_of(series)] == ["reward/mean", "grpo/loss", "completion/len_mean"]
    flat = {**series, "grpo/clip_frac": ([1.0, 2.0], [0.0, 0.0]), "grpo/optimizer_steps": ([1.0, 2.0], [1.0, 1.0]),
            "grpo/kl": ([1.0, 2.0], [0.0, 0.0])}
    assert "grpo/clip_frac" not in [p.metric for p in panels_of(flat)]  # pi_old is the policy: exactly 0
    assert "grpo/kl" not in [p.metric for p in panels_of(flat)]  # beta = 0
    moving = {**flat, "grpo/optimizer_steps": ([1.0, 2.0], [2.0, 2.0]), "grpo/kl": ([1.0, 2.0], [0.0, 0.2])}
    assert [p.metric for p in panels_of(moving)] == ["reward/mean", "grpo/loss", "grpo/kl", "grpo/clip_frac",
                                                     "completion/len_mean"]
    curves = plot_curves(csv_path, window=2)
    assert curves.lines[SMOOTHED.format(metric="reward/mean", window=2)] == ([1.0, 2.0], [0.1, 0.2])
    assert sum(ax.axison for ax in curves.figure.axes) == 3


def test_a_dpo_run_gets_loss_accuracy_and_margin_panels(tmp_path):
    """A DPO run's curves.png was four empty panels: it logs no reward/mean, grpo/loss, ... ."""
    rows = [{"step": 1, "loop_step": 1, "dpo/loss": 0.69, "dpo/accuracy": 0.0, "dpo/margin": 0.0},
            {"step": 2, "loop_step": 2, "dpo/loss": 0.6, "dpo/accuracy": 0.5, "dpo/margin": 0.1},
            {"step": 2, "val/accuracy": 0.6, "val/reward_accuracy": 0.5, "val/margin": 0.05}]
    _write_rows(tmp_path / "metrics.csv", rows)
    curves = plot_curves(tmp_path / "metrics.csv")
    assert next(ax.get_title() for ax in curves.figure.axes if ax.axison) == "DPO loss"
    assert curves.lines["val/accuracy"] == ([2.0], [0.6])
    assert {"dpo/loss", "dpo/margin", "val/margin"} <= curves.lines.keys()
    # one accuracy series: not the implicit-reward one, 0.0 while every margin is a tie (main drew three)
    assert not {"dpo/accuracy", "val/reward_accuracy"} & curves.lines.keys()
    _write_rows(tmp_path / "metrics.csv", rows[:2])
    no_val = plot_curves(tmp_path / "metrics.csv")
    assert no_val.lines["dpo/accuracy"] == ([1.0, 2.0], [0.0, 0.5])  # without validation: the training accuracy


def test_a_tool_run_gets_a_tools_panel(tmp_path):
    rows = [{"step": s, "loop_step": s, "reward/mean": 0.1 * s, "tools/call_frequency": 1.0 + s,
             "tools/failure_frequency": 0.5 / s, "episode/turns_mean": 1.5 + s / 10} for s in (1, 2)]
    rows.append({"step": 2, "val/reward": 0.4, "val/tools/call_frequency": 2.5})
    _write_rows(tmp_path / "metrics.csv", rows)
    curves = plot_curves(tmp_path / "metrics.csv")
    assert "tools (per episode)" in [ax.get_title() for ax in curves.figure.axes if ax.axison]
    assert curves.lines["tools/failure_frequency"] == ([1.0, 2.0], [0.5, 0.25])
    assert curves.lines["episode/turns_mean"] == ([1.0, 2.0], [1.6, 1.7])
    assert curves.lines["val/tools/call_frequency"] == ([2.0], [2.5])
    _write_rows(tmp_path / "metrics.csv", [{"step": 1, "loop_step": 1, "reward/mean": 0.1}])
    assert "tools/call_frequency" not in plot_curves(tmp_path / "metrics.csv").lines  # single-turn: no panel


def test_plot_of_a_folder_takes_the_newest_fit_not_a_newer_validate_run(tmp_path, capsys):
    fit, validate = tmp_path / "runs" / "x" / "version_0", tmp_path / "runs" / "x" / "version_1"
    _write_rows(fit / "metrics.csv", [{"step": 1, "loop_step": 1, "reward/mean": 0.5}])
    _write_rows(validate / "metrics.csv", [{"step": 80, "val/reward": 0.5}])
    os.utime(validate / "metrics.csv", (2e9, 2e9))  # newer
    assert find_metrics(tmp_path / "runs") == fit / "metrics.csv"
    assert find_metrics(validate) == validate / "metrics.csv"  # named: drawn as asked


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


def _write_rows(path, rows: list[dict]) -> None:
    os.makedirs(path.parent, exist_ok=True)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


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
