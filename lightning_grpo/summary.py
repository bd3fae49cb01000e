"""RunSummary: a short report at the end of a fit (loop steps, first/last figures, validation, throughput, where logs are).

It keeps the very rows the loggers get (each loop step's roll-up, each logged validation, the one before training
at loop step 0 included: ``validation.is_measurement``), labelled with the module's loop step (also across a
resume), and takes first/last the way ``lightning-grpo plot`` draws them (``plot.smoothed``): the summary,
metrics.csv and curves.png give the same numbers. A resume logs into a new version folder, whose metrics.csv and
curves.png hold only its own loop steps: the ``logs`` line then says which loop steps each folder holds. GRPO/OPD runs report reward, DPO runs loss and accuracy.
"""

from __future__ import annotations

import time

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

from lightning_grpo.checkpoint.signals import Preempted
from lightning_grpo.plot import (
    REPLACED_BY,
    PlotError,
    Series,
    plot_curves,
    series_of,
    smoothed,
)
from lightning_grpo.validation import is_measurement

HEADLINES = {
    "reward/mean": "reward",
    "dpo/loss": "dpo/loss",
    "dpo/accuracy": "dpo/accuracy",
}
"""Training metrics reported first/last (trailing mean over ``window`` loop steps) when the run logs them: label."""
VAL_HEADLINES = ("val/reward", "val/accuracy")
"""Validation metrics reported first/last (one value per validation, with its loop step) when logged."""
NOT_MEASURED = "  validation       not measured (no validation ran: trainer.val_check_interval, data.val_size)"
THROUGHPUT = {"grpo/tokens": "trained tokens/s", "dpo/pairs": "trained pairs/s"}
"""Per-loop-step counts summed into the wall-time line."""


class RunSummary(Callback):
    """Prints what a person wants to know when a run ends.

    Args:
        window: loop steps averaged for the "first" and "last" figures (and the plot's trailing mean).
        plot: with a ``CSVLogger``, draw the curves (``lightning-grpo plot``) into ``curves.png`` in
            its log dir when the run ends; False (or matplotlib missing) prints the command instead.

    Example::

        Trainer(callbacks=[RunSummary(window=5)])
    """

    def __init__(self, window: int = 5, plot: bool = True) -> None:
        if window < 1:
            raise ValueError(f"RunSummary(window={window}): must be >= 1")
        self.window = window
        self.plot = plot
        # per loop step: its step and the HEADLINES it logged
        self._rows: list[dict[str, float]] = []
        # per logged validation: its loop step and the VAL_HEADLINES
        self._val: list[dict[str, float]] = []
        # THROUGHPUT counts of this fit (not of the run a resume continues)
        self._counts: dict[str, float] = {}
        self._start = 0.0
        self._first_step = 0
        # earlier fits of this run (a resume): their loop steps and log folder
        self._earlier: list[dict] = []
        # this fit's log folder (where metrics.csv and curves.png are)
        self._log_dir: str | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # a fresh fit starts empty; a resume loads its rows after this (load_state_dict)
        if stage == "fit":
            self._rows = []
            self._val = []
            self._earlier = []

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.perf_counter()
        self._counts = {}
        # UpdateModule's: a loaded checkpoint's
        self._first_step = int(getattr(pl_module, "loop_step", 0))
        # on every rank: a broadcast under DDP
        self._log_dir = getattr(trainer, "log_dir", None)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not is_measurement(trainer):
            return
        values = {
            k: float(v)
            for k, v in trainer.callback_metrics.items()
            if k in VAL_HEADLINES
        }
        step = float(getattr(pl_module, "loop_step", len(self._rows)))
        # a loop step already measured counts once
        if not values or (self._val and self._val[-1]["step"] == step):
            return
        self._val.append({"step": step, **values})

    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs,
        batch,
        batch_idx: int,
    ) -> None:
        metrics = getattr(pl_module, "last_metrics", {})
        step = float(
            metrics.get("step", getattr(pl_module, "loop_step", len(self._rows) + 1))
        )
        self._rows.append(
            {"step": step, **{k: float(metrics[k]) for k in HEADLINES if k in metrics}}
        )
        for key in THROUGHPUT.keys() & metrics.keys():
            self._counts[key] = self._counts.get(key, 0.0) + float(metrics[key])

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # on every rank: trainer.log_dir is a broadcast under DDP
        report = self.report(trainer)
        if trainer.is_global_zero:
            print(report + self._curves(trainer), flush=True)

    @override
    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        # a preempted run still says what it did and where it resumes from
        if isinstance(exception, Preempted):
            report = self.report(trainer)
            if trainer.is_global_zero:
                print(f"{report}\n  stopped          {exception}", flush=True)

    def report(self, trainer: Trainer) -> str:
        seconds = time.perf_counter() - self._start
        series = series_of(self._rows + self._val)
        rates = [
            f"{count / max(seconds, 1e-9):.0f} {THROUGHPUT[key]}"
            for key, count in self._counts.items()
        ]
        lines = [
            "",
            "lightning-grpo run summary",
            self._steps_line(trainer),
            *self._train_lines(series),
            *self._val_lines(series),
            f"  wall time        {seconds:.1f} s"
            + (f", {', '.join(rates)} (all ranks)" if rates else ""),
            f"  logs             {trainer.log_dir}{self._where_steps_are()}",
        ]
        seed = getattr(trainer.lightning_module, "seed", None)
        # the effective seed, and where it came from (model.seed or seed_everything)
        if seed is not None:
            lines.insert(
                2,
                f"  seed             {seed}  (from {getattr(trainer.lightning_module, 'seed_source', '?')})",
            )
        return "\n".join(lines)

    def _steps_line(self, trainer: Trainer) -> str:
        last = int(self._rows[-1]["step"]) if self._rows else self._first_step
        resumed = (
            f"{last - self._first_step} in this fit, from loop step {self._first_step}; "
            if self._first_step
            else ""
        )
        return f"  loop steps       {last}  ({resumed}optimizer steps: {trainer.global_step})"

    def _train_lines(self, series: dict[str, Series]) -> list[str]:
        """First and last ``window``-step means of each headline metric, with the loop steps they cover."""
        lines = []
        shown = [
            m for m in HEADLINES if m in series and REPLACED_BY.get(m) not in series
        ]
        for metric in shown:
            xs, ys = series[metric]
            w = min(self.window, len(series[metric][1]))
            mean = smoothed(ys, self.window)
            first = mean[w - 1]
            last = mean[-1]
            label = HEADLINES[metric]
            span = f"loop steps {xs[-w]:.0f}-{xs[-1]:.0f}, {last - first:+.3f}"
            lines += [
                f"  {f'{label} first {w}':<16} {first:.3f}  (loop steps {xs[0]:.0f}-{xs[w - 1]:.0f})",
                f"  {f'{label} last {w}':<16} {last:.3f}  ({span})",
            ]
        return lines

    def _val_lines(self, series: dict[str, Series]) -> list[str]:
        """First and last value of each validation metric (greedy / held-out) with the loop step each was taken at."""
        lines = []
        for metric in (m for m in VAL_HEADLINES if m in series):
            xs, ys = series[metric]
            last = (
                f"loop step {xs[-1]:.0f}, {ys[-1] - ys[0]:+.3f}; {len(xs)} validations"
            )
            lines += [
                f"  {metric} first {ys[0]:.3f}  (loop step {xs[0]:.0f})",
                f"  {metric} last  {ys[-1]:.3f}  ({last})",
            ]
        return lines or [NOT_MEASURED]

    def _spans(self) -> list[dict]:
        """Which folder logged which loop steps, over the fits of this run (consecutive fits of one folder merged)."""
        spans = []
        last = int(self._rows[-1]["step"]) if self._rows else self._first_step
        this = [
            {"first": self._first_step + 1, "last": last, "dir": str(self._log_dir)}
        ]
        for span in self._earlier + (
            this if last > self._first_step and self._log_dir is not None else []
        ):
            if spans and spans[-1]["dir"] == span["dir"]:
                spans[-1]["last"] = span["last"]
            else:
                spans.append(dict(span))
        return spans

    def _where_steps_are(self) -> str:
        """After a resume into a new folder: this folder's loop steps (its metrics.csv and curves.png hold only
        those) and the folders of the earlier ones; the figures above span them all."""
        spans = self._spans()
        if len(spans) < 2:
            return ""
        earlier = "; ".join(
            f"loop steps {s['first']}-{s['last']}: {s['dir']}" for s in spans[:-1]
        )
        return f"  (loop steps {spans[-1]['first']}-{spans[-1]['last']}; {earlier})"

    def _curves(self, trainer: Trainer) -> str:
        """The summary's last line: where the curves PNG is, or the command that makes it (rank 0 only)."""
        csv_logger = next(
            (lg for lg in trainer.loggers if isinstance(lg, CSVLogger)), None
        )
        if csv_logger is None:
            return ""  # no CSV to plot (e.g. only W&B, which draws its own curves)
        command = f"lightning-grpo plot {csv_logger.log_dir}"
        if not self.plot:
            return f"\n  curves           {command}"
        # flush the buffered rows now: the logger's own final save comes after this hook
        csv_logger.save()
        try:
            png = plot_curves(
                csv_logger.experiment.metrics_file_path, window=self.window
            ).png
        except PlotError as err:
            return f"\n  curves           {command}  ({err})"
        # noqa: BLE001 - a plotting failure must not fail a finished run
        except Exception as err:
            return f"\n  curves           {command}  (plot failed: {err!r})"
        return f"\n  curves           {png}  (redraw: {command})"

    def state_dict(self) -> dict:
        return {
            "rows": [dict(r) for r in self._rows],
            "val_rows": [dict(v) for v in self._val],
            "folders": self._spans(),
        }

    def load_state_dict(self, state: dict) -> None:
        # an older checkpoint: rewards per loop step, (step, val/reward) pairs
        if "rows" not in state:
            self._rows = [
                {"step": float(i + 1), "reward/mean": r}
                for i, r in enumerate(state.get("rewards", []))
            ]
            self._val = [
                {"step": float(s), "val/reward": v} for s, v in state.get("val", [])
            ]
            return
        self._rows = [dict(r) for r in state["rows"]]
        self._val = [dict(v) for v in state["val_rows"]]
        # older checkpoints: not recorded
        self._earlier = [dict(f) for f in state.get("folders", [])]
