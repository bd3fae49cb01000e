"""``lightning-grpo plot <log dir>``: the four curves a person checks first, one PNG, per loop step.

Reads ``metrics.csv`` of a ``CSVLogger`` run (the CLI's default logger; one row per loop step, plus
one row per validation) and draws reward, loss, clip fraction and completion length against the
logged ``step`` (the loop step). Held-out ``val/reward`` (greedy) joins the reward panel when the
run validated. matplotlib is an optional extra: ``pip install 'lightning-grpo[plot]'``.

    lightning-grpo plot runs/quickstart/version_0          # writes runs/quickstart/version_0/curves.png
    lightning-grpo plot runs/quickstart -o /tmp/curves.png # the newest run under the folder
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Sequence
from pathlib import Path

PANELS = (
    ("reward/mean", "reward (mean over the collected batch)"),
    ("grpo/loss", "loss"),
    ("grpo/clip_frac", "clip fraction (share of tokens)"),
    ("completion/len_mean", "completion length (tokens)"),
)
"""(metric, panel title), in drawing order: left to right, top to bottom."""
OVERLAYS = {"reward/mean": "val/reward"}
"""A second line drawn on a panel when the run logged it (validation: greedy, held-out)."""
PNG_NAME = "curves.png"
DESCRIPTION = "Draw reward, loss, clip fraction and completion length of a CSVLogger run into one PNG."

Series = tuple[list[float], list[float]]  # (loop steps, values) of the rows that logged the metric


class PlotError(RuntimeError):
    """The plot cannot be made (matplotlib missing, no metrics.csv, no step column); the message says why."""


def find_metrics(path: str | Path) -> Path:
    """The ``metrics.csv`` a path means: the file itself, the one in a folder, or the newest one below it."""
    path = Path(path)
    if path.is_file():
        return path
    if (path / "metrics.csv").is_file():
        return path / "metrics.csv"
    found = sorted(path.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime) if path.is_dir() else []
    if not found:
        raise PlotError(
            f"no metrics.csv at or under {str(path)!r}: give a CSVLogger log dir (e.g. runs/quickstart/version_0); "
            "runs logged only to another logger (W&B) have no CSV to plot"
        )
    return found[-1]


def read_series(csv_path: str | Path) -> dict[str, Series]:
    """Every numeric column as (steps, values), keeping only the rows where that column was logged."""
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and "step" not in rows[0]:
        raise PlotError(f"{csv_path}: no 'step' column; is it a Lightning CSVLogger metrics.csv?")
    series: dict[str, Series] = {}
    for row in rows:
        step = _number(row.get("step"))
        if step is None:
            continue
        for key, raw in row.items():
            value = _number(raw)
            if key != "step" and value is not None:
                xs, ys = series.setdefault(key, ([], []))
                xs.append(step)
                ys.append(value)
    return series


def plot_curves(csv_path: str | Path, output: str | Path | None = None):
    """Draw the panels of ``csv_path`` into a PNG (default: ``curves.png`` beside it).

    Returns:
        ``(png_path, figure)``: the figure's four axes hold exactly the logged values.

    Raises:
        PlotError: matplotlib is not installed, or the CSV cannot be read as a Lightning log.
    """
    figure_cls = _figure_class()
    csv_path = Path(csv_path)
    output = Path(output) if output is not None else csv_path.with_name(PNG_NAME)
    series = read_series(csv_path)
    fig = figure_cls(figsize=(11, 7), layout="constrained")
    for ax, (metric, title) in zip(fig.subplots(2, 2).flat, PANELS):
        _panel(ax, series, metric, title)
    steps = max((len(series[m][0]) for m, _ in PANELS if m in series), default=0)
    fig.suptitle(f"{csv_path.parent}  ({steps} loop steps)")
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    return output, fig


def _panel(ax, series: dict[str, Series], metric: str, title: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=10)
    ax.set_xlabel("loop step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if metric not in series:
        ax.text(0.5, 0.5, f"{metric} not logged", ha="center", va="center", transform=ax.transAxes)
        return
    ax.plot(*series[metric], label=metric, marker="." if len(series[metric][0]) < 50 else None)
    overlay = OVERLAYS.get(metric)
    if overlay in series:
        ax.plot(*series[overlay], label=f"{overlay} (greedy, held-out)", marker="o")
    ax.legend(fontsize=8)


def _figure_class():
    try:
        from matplotlib.figure import Figure  # no pyplot: no global state, no display backend
    except ImportError as err:
        raise PlotError(
            "lightning-grpo plot needs matplotlib, an optional extra: pip install 'lightning-grpo[plot]' "
            "(or pip install matplotlib)"
        ) from err
    return Figure


def _number(raw: str | None) -> float | None:
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if not math.isinf(value) else None


def build_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``plot`` arguments (``parser_class``: the CLI lists ``plot`` among its subcommands with a jsonargparse one)."""
    parser = parser_class(prog="lightning-grpo plot", description=DESCRIPTION)
    parser.add_argument("log_dir", help="a CSVLogger run folder (or its metrics.csv, or a folder of runs: the newest)")
    parser.add_argument("-o", "--output", help=f"PNG to write (default: {PNG_NAME} beside metrics.csv)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """``lightning-grpo plot LOG_DIR [-o OUT]``."""
    args = build_parser().parse_args(argv)
    try:
        png, _ = plot_curves(find_metrics(args.log_dir), args.output)
    except PlotError as err:
        print(f"lightning-grpo plot: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(png)


if __name__ == "__main__":
    main()
