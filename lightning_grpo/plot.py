"""``lightning-grpo plot <log dir>``: the curves a person checks first, one PNG, per loop step.

Reads ``metrics.csv`` of a ``CSVLogger`` run (the CLI's default logger; one row per loop step, plus
one row per validation, the one before training at loop step 0 included) and draws, against the
logged ``step`` (the loop step), each panel whose metric the run logged: GRPO's reward (raw, its
trailing mean over ``window`` loop steps, and the held-out greedy ``val/reward``), loss, KL when it
moved, clip fraction when it can be non-zero, completion length, and with ``model.env`` the tools (calls and
failed calls per episode, turns); DPO's loss, held-out accuracy and margin (with ``val/margin``).
matplotlib is an optional extra: ``pip install 'lightning-grpo[plot]'``.

    lightning-grpo plot runs/quickstart/version_0          # writes runs/quickstart/version_0/curves.png
    lightning-grpo plot runs/quickstart -o /tmp/curves.png # the newest fit run under the folder
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

# (loop steps, values) of the rows that logged the metric
Series = tuple[list[float], list[float]]


def _moved(series: Series) -> bool:
    return any(v != 0 for v in series[1])


def _kl_moved(series: dict[str, Series]) -> bool:
    return _moved(series["grpo/kl"])


def _can_clip(series: dict[str, Series]) -> bool:
    """The clip fraction is exactly 0 while pi_old is the policy itself (one optimizer step per loop step, no sampler
    pi_old): drawn when a loop step took several optimizer steps, or a clip was seen."""
    return _moved(series["grpo/clip_frac"]) or any(
        v > 1 for v in series.get("grpo/optimizer_steps", ([], []))[1]
    )


REPLACED_BY = {"dpo/accuracy": "val/accuracy"}
"""Metrics drawn (and reported by the run summary) only when the run did not log the named one. DPO shows one
accuracy, the held-out policy preference, right at loop step 0 (~0.5); the implicit-reward accuracy is 0 there,
every margin being an exact tie."""


def _not_replaced(metric: str, series: dict[str, Series]) -> bool:
    return REPLACED_BY.get(metric) not in series


def _always(series: dict[str, Series]) -> bool:
    return True


class Panel(NamedTuple):
    """One panel of the figure: the metric it draws, its title, the lines drawn over it, and when it is drawn."""

    metric: str
    title: str
    overlays: tuple[str, ...] = ()
    """Further lines drawn when the run logged them (validation: greedy or held-out)."""
    when: Callable[[dict[str, Series]], bool] = _always
    """Drawn only when this holds (beyond the metric being logged)."""


PANELS = (
    Panel("reward/mean", "reward (mean over the collected batch)", ("val/reward",)),
    Panel("grpo/loss", "loss"),
    Panel("dpo/loss", "DPO loss"),
    Panel("val/accuracy", "held-out accuracy (the policy prefers the chosen answer)"),
    Panel(
        "dpo/accuracy",
        "accuracy (chosen ranked first)",
        when=functools.partial(_not_replaced, "dpo/accuracy"),
    ),
    Panel("dpo/margin", "implicit reward margin (chosen - rejected)", ("val/margin",)),
    Panel(
        "grpo/kl",
        "KL to the reference (nats/token)",
        when=_kl_moved,
    ),
    Panel("opd/kl", "reverse KL to the teacher (nats/token)"),
    Panel("grpo/clip_frac", "clip fraction (share of tokens)", when=_can_clip),
    Panel("completion/len_mean", "completion length (tokens)"),
    Panel(
        "tools/call_frequency",
        "tools (per episode)",
        ("tools/failure_frequency", "episode/turns_mean", "val/tools/call_frequency"),
    ),
)
"""Every panel a run may get, in drawing order (left to right, top to bottom); a run gets those it logged."""
SMOOTHED = "{metric} (mean of last {window})"
"""Label of the trailing mean drawn beside the first panel's raw curve (the summary's first/last figures)."""
PNG_NAME = "curves.png"
DESCRIPTION = (
    "Draw reward, loss, KL, clip fraction, completion length and tool use (DPO: loss, accuracy, margin) "
    "of a CSVLogger run into one PNG."
)
FIT_COLUMN = "loop_step"
"""Logged by every training row (GRPO, OPD, DPO): a metrics.csv without it holds no fit (a ``validate`` run)."""


class Curves(NamedTuple):
    """What ``plot_curves`` drew: the PNG, the figure and each line's data by label (metric name or SMOOTHED)."""

    png: Path
    figure: object
    lines: dict[str, Series]


class PlotError(RuntimeError):
    """The plot cannot be made (matplotlib missing, no metrics.csv, no step column); the message says why."""


def find_metrics(path: str | Path) -> Path:
    """The ``metrics.csv`` a path means: the file itself, the one in a folder, or the newest fit run's below it
    (a ``validate`` run logs no training rows; it is taken only when no fit run is there)."""
    path = Path(path)
    if path.is_file():
        return path
    if (path / "metrics.csv").is_file():
        return path / "metrics.csv"
    found = (
        sorted(path.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
        if path.is_dir()
        else []
    )
    if not found:
        raise PlotError(
            f"no metrics.csv at or under {str(path)!r}: give a CSVLogger log dir (e.g. runs/quickstart/version_0); "
            "runs logged only to another logger (W&B) have no CSV to plot"
        )
    fits = [p for p in found if FIT_COLUMN in _header(p)]
    return (fits or found)[-1]


def _header(csv_path: Path) -> list[str]:
    with open(csv_path, newline="") as f:
        return next(csv.reader(f), [])


def read_series(csv_path: str | Path) -> dict[str, Series]:
    """Every numeric column as (steps, values), keeping only the rows where that column was logged."""
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and "step" not in rows[0]:
        raise PlotError(
            f"{csv_path}: no 'step' column; is it a Lightning CSVLogger metrics.csv?"
        )
    return series_of(rows)


def series_of(rows: Sequence[dict]) -> dict[str, Series]:
    """Rows of logged metrics (each with its ``step``; values as numbers or CSV strings) as one Series per name."""
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


def smoothed(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (fewer at the start): its last value is the mean of the last ``window``,
    its value at index ``window - 1`` the mean of the first ``window``."""
    out = []
    for i in range(len(values)):
        part = values[max(i + 1 - window, 0) : i + 1]
        out.append(sum(part) / len(part))
    return out


def panels_of(series: dict[str, Series]) -> list[Panel]:
    """The panels a run with these series gets."""
    return [p for p in PANELS if p.metric in series and p.when(series)]


def plot_curves(
    csv_path: str | Path, output: str | Path | None = None, window: int = 5
) -> Curves:
    """Draw the panels of ``csv_path`` into a PNG (default: ``curves.png`` beside it).

    Args:
        window: loop steps of the trailing mean drawn beside the first panel's raw curve.

    Returns:
        ``Curves``: the PNG, the figure, and the data of every line drawn (exactly the logged values).

    Raises:
        PlotError: matplotlib is not installed, or the CSV cannot be read as a Lightning log.
    """
    figure_cls = _figure_class()
    csv_path = Path(csv_path)
    output = Path(output) if output is not None else csv_path.with_name(PNG_NAME)
    series = read_series(csv_path)
    panels = panels_of(series)
    cols = 2 if len(panels) <= 4 else 3
    rows = max(math.ceil(len(panels) / cols), 1)
    fig = figure_cls(figsize=(5.5 * cols, 3.5 * rows), layout="constrained")
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    lines: dict[str, Series] = {}
    for i, (ax, panel) in enumerate(zip(axes, panels)):
        lines |= _panel(ax, series, panel, window if i == 0 else 0)
    for ax in axes[len(panels) :]:
        ax.set_axis_off()
    if not panels:
        axes[0].text(
            0.5,
            0.5,
            "no training rows logged (a validate run?)",
            ha="center",
            va="center",
        )
    steps = len(series.get(FIT_COLUMN, ([], []))[0])
    fig.suptitle(f"{csv_path.parent}  ({steps} loop steps)")
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    return Curves(output, fig, lines)


def _panel(
    ax, series: dict[str, Series], panel: Panel, window: int
) -> dict[str, Series]:
    """Draw one panel (with the trailing mean when ``window`` > 1); the data of each line drawn, by label."""
    from matplotlib.ticker import MaxNLocator

    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("loop step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    xs, ys = series[panel.metric]
    drawn = {panel.metric: (xs, ys)}
    ax.plot(
        xs,
        ys,
        label=panel.metric,
        marker="." if len(xs) < 50 else None,
        alpha=0.5 if window > 1 else 1.0,
    )
    if window > 1:
        label = SMOOTHED.format(metric=panel.metric, window=window)
        drawn[label] = (xs, smoothed(ys, window))
        ax.plot(*drawn[label], label=label)
    for overlay in (name for name in panel.overlays if name in series):
        drawn[overlay] = series[overlay]
        held_out = overlay.startswith("val/")
        label = f"{overlay} (held-out)" if held_out else overlay
        ax.plot(*drawn[overlay], label=label, marker="o" if held_out else None)
    ax.legend(fontsize=8)
    return drawn


def _figure_class():
    try:
        # no pyplot: no global state, no display backend
        from matplotlib.figure import Figure
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


def build_parser(
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
) -> argparse.ArgumentParser:
    """The ``plot`` arguments (``parser_class``: the CLI lists ``plot`` among its subcommands with a jsonargparse one)."""
    parser = parser_class(prog="lightning-grpo plot", description=DESCRIPTION)
    parser.add_argument(
        "log_dir",
        help="a CSVLogger run folder (or its metrics.csv, or a folder of runs: the newest fit)",
    )
    parser.add_argument(
        "-o", "--output", help=f"PNG to write (default: {PNG_NAME} beside metrics.csv)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """``lightning-grpo plot LOG_DIR [-o OUT]``."""
    args = build_parser().parse_args(argv)
    try:
        png = plot_curves(find_metrics(args.log_dir), args.output).png
    except PlotError as err:
        print(f"lightning-grpo plot: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(png)


if __name__ == "__main__":
    main()
