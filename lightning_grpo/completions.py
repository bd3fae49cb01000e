"""What the model writes: a few completions of every loop step, in ``completions.jsonl``, W&B and the console.

Metrics say *that* reward rose; only the completions say *why* (a format hack, an answer copied from the prompt,
one long repetition). The ``Collector`` keeps the loop step's rows (``StepRows``: rollouts, rewards, the
reward parts per function, advantages); ``CompletionLog`` picks ``samples_per_step`` of them, one per group
first, and

- appends them to ``<run folder>/completions.jsonl`` (one JSON object a line; append, so a resume into the same
  folder loses nothing and a row's ``step`` is the loop step it was drawn at),
- logs them as a W&B Table ``completions`` when a ``WandbLogger`` is attached,
- prints one every ``log_completions_every`` loop steps.

An episode (``model.env``) shows whole: its prompt as the model saw it (tool schemas included), each turn's text, the
tool calls with their arguments and results, and which tokens trained; ``lightning-grpo show`` prints a step's rows
the same way. OPD rows show the per-token KL to the teacher instead of an advantage
(``objectives.base.ExplainsTokens``).

A write that fails (a full disk) stops the run at the next hook, once the loop step's metrics row is logged: the
checkpoint callback saves that batch boundary and the CLI names the file and the fix (``errors.write_failed``).

Rank 0 writes its own share of the batch (other ranks' rows would cost a gather for a few examples).
"""

from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger
from typing_extensions import override

from lightning_grpo.collect.rows import StepRows
from lightning_grpo.show import FILE, format_sample

__all__ = ["COLUMNS", "EPISODE_COLUMNS", "FILE", "CompletionLog", "format_sample"]

COLUMNS = (
    "step",
    "prompt_id",
    "prompt",
    "completion",
    "reward",
    "rewards",
    "advantage",
    "finish_reason",
    "trained",
)
EPISODE_COLUMNS = (*COLUMNS, "turns")
"""With ``model.env``: each row also holds its turns (text, tool calls with arguments and results, token counts)."""
JSON_COLUMNS = ("rewards", "turns")


class CompletionLog(Callback):
    """Writes a few completions of every loop step where a person can read them.

    Args:
        samples_per_step: rows written per loop step (0: none; the console line and the Table need rows).
        log_completions_every: print one sample every this many loop steps (0: never).

    Example::

        Trainer(callbacks=[CompletionLog(samples_per_step=4, log_completions_every=10)])
    """

    def __init__(
        self, samples_per_step: int = 4, log_completions_every: int = 10
    ) -> None:
        if samples_per_step < 0 or log_completions_every < 0:
            raise ValueError(
                f"CompletionLog(samples_per_step={samples_per_step}, log_completions_every="
                f"{log_completions_every}): both must be >= 0 (0 = off)"
            )
        self.samples_per_step = samples_per_step
        self.log_completions_every = log_completions_every
        self._path: Path | None = None
        # a write that failed, raised at the next hook (see _append)
        self._failed: OSError | None = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        folder = trainer.log_dir  # on every rank: a broadcast under DDP
        self._path = (
            Path(folder) / FILE
            if folder is not None and trainer.is_global_zero
            else None
        )

    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs,
        batch,
        batch_idx: int,
    ) -> None:
        rows: StepRows | None = getattr(pl_module, "last_rows", None)
        if not trainer.is_global_zero or rows is None or self.samples_per_step == 0:
            return
        samples = rows.samples(self.samples_per_step, pl_module.rl.group_size)
        if self._path is not None:
            self._append(samples)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                columns = (
                    EPISODE_COLUMNS if any("turns" in s for s in samples) else COLUMNS
                )
                data = [
                    [
                        json.dumps(s.get(c)) if c in JSON_COLUMNS else s[c]
                        for c in columns
                    ]
                    for s in samples
                ]
                logger.log_table("completions", columns=list(columns), data=data)
        every = self.log_completions_every
        if every and samples and rows.step % every == 0:
            _print(trainer, format_sample(samples[0]))

    def _append(self, samples: list[dict]) -> None:
        """Append to completions.jsonl; a failed write (a full disk) is raised once this loop step's row is logged."""
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            with self._path.open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(s, ensure_ascii=False) + "\n" for s in samples)
        except OSError as err:
            # a failed write() names no file
            err.filename = err.filename or str(self._path)
            self._failed = err

    # The first hooks after Lightning logged the loop step's metrics row: the run stops there, so the emergency
    # checkpoint of this boundary (GRPOCheckpoint.on_exception) never exists without its row.
    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int
    ) -> None:
        self._raise_failed()

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._raise_failed()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._raise_failed()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._raise_failed()

    def _raise_failed(self) -> None:
        failed = self._failed
        self._failed = None
        if failed is not None:
            raise failed


def _print(trainer: Trainer, text: str) -> None:
    """Above the progress bar when there is one (a plain print would break its line)."""
    bar = trainer.progress_bar_callback
    (bar.print if bar is not None and hasattr(bar, "print") else print)(text)
