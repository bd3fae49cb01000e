"""RunSummary: a short report at the end of a fit (steps, reward first/last, throughput, where logs are)."""

from __future__ import annotations

import time

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

from lightning_grpo.checkpoint.signals import Preempted
from lightning_grpo.plot import PlotError, plot_curves


class RunSummary(Callback):
    """Prints what a person wants to know when a run ends.

    Args:
        window: loop steps averaged for the "first" and "last" reward.
        plot: with a ``CSVLogger``, draw the curves (``lightning-grpo plot``) into ``curves.png`` in
            its log dir when the run ends; False (or matplotlib missing) prints the command instead.

    Example::

        Trainer(callbacks=[RunSummary(window=5)])
    """

    def __init__(self, window: int = 5, plot: bool = True) -> None:
        if window < 1:
            raise ValueError(f"RunSummary(window={window}): must be >= 1")
        self.window, self.plot = window, plot
        self._rewards: list[float] = []
        self._val: list[tuple[int, float]] = []  # (loop step, val/reward) of each validation
        self._tokens = 0.0
        self._start = 0.0

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start, self._rewards, self._tokens = time.perf_counter(), [], 0.0

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        value = trainer.callback_metrics.get("val/reward")
        # Lightning's sanity check counts when it ran every held-out batch (trainer.num_sanity_val_steps: -1): a
        # validation of the weights training starts from (loop step 0, or the resumed step).
        if value is None or (trainer.sanity_checking
                             and sum(trainer.num_sanity_val_batches) < sum(trainer.num_val_batches)):
            return
        step = len(self._rewards)
        if self._val and self._val[-1][0] == step:  # a resume validates the step its checkpoint already did
            return
        self._val.append((step, float(value)))

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        metrics = getattr(pl_module, "last_metrics", {})
        if "reward/mean" in metrics:
            self._rewards.append(float(metrics["reward/mean"]))
        self._tokens += float(metrics.get("grpo/tokens", 0.0))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        report = self.report(trainer)  # on every rank: trainer.log_dir is a broadcast under DDP
        if trainer.is_global_zero:
            print(report + self._curves(trainer), flush=True)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, Preempted):  # a preempted run still says what it did and where it resumes from
            report = self.report(trainer)
            if trainer.is_global_zero:
                print(f"{report}\n  stopped          {exception}", flush=True)

    def report(self, trainer: Trainer) -> str:
        seconds = time.perf_counter() - self._start
        w, r = self.window, self._rewards
        first, last = _mean(r[:w]), _mean(r[-w:])
        lines = [
            "",
            "lightning-grpo run summary",
            f"  loop steps       {len(r)}  (optimizer steps: {trainer.global_step})",
            f"  reward first {w:<3} {first:.3f}",
            f"  reward last {w:<4} {last:.3f}  ({last - first:+.3f})",
            *self._val_lines(),
            f"  wall time        {seconds:.1f} s, {self._tokens / max(seconds, 1e-9):.0f} trained tokens/s (all ranks)",
            f"  logs             {trainer.log_dir}",
        ]
        seed = getattr(trainer.lightning_module, "seed", None)
        if seed is not None:  # the effective seed, and where it came from (model.seed or seed_everything)
            lines.insert(2, f"  seed             {seed}  (from {getattr(trainer.lightning_module, 'seed_source', '?')})")
        return "\n".join(lines)

    def _val_lines(self) -> list[str]:
        """First and last ``val/reward`` (greedy, held-out prompts) with the loop step each was taken at."""
        if not self._val:
            return ["  val/reward       not measured (no validation ran: trainer.val_check_interval, data.val_size)"]
        (s0, v0), (s1, v1) = self._val[0], self._val[-1]
        return [f"  val/reward first {v0:.3f}  (loop step {s0})",
                f"  val/reward last  {v1:.3f}  (loop step {s1}, {v1 - v0:+.3f}; {len(self._val)} validations)"]

    def _curves(self, trainer: Trainer) -> str:
        """The summary's last line: where the curves PNG is, or the command that makes it (rank 0 only)."""
        csv_logger = next((lg for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)
        if csv_logger is None:
            return ""  # no CSV to plot (e.g. only W&B, which draws its own curves)
        command = f"lightning-grpo plot {csv_logger.log_dir}"
        if not self.plot:
            return f"\n  curves           {command}"
        csv_logger.save()  # flush the buffered rows now: the logger's own final save comes after this hook
        try:
            png, _ = plot_curves(csv_logger.experiment.metrics_file_path)
        except PlotError as err:
            return f"\n  curves           {command}  ({err})"
        except Exception as err:  # noqa: BLE001 - a plotting failure must not fail a finished run
            return f"\n  curves           {command}  (plot failed: {err!r})"
        return f"\n  curves           {png}  (redraw: {command})"

    def state_dict(self) -> dict:
        return {"rewards": list(self._rewards), "tokens": self._tokens, "val": [list(v) for v in self._val]}

    def load_state_dict(self, state: dict) -> None:
        self._rewards, self._tokens = list(state["rewards"]), state["tokens"]
        self._val = [tuple(v) for v in state.get("val", [])]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
