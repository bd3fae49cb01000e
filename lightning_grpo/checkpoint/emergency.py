"""The emergency save: whether a run failing inside a loop step may save the batch boundary it left.

Before the loop step's first optimizer step the parameters and optimizer state are still those of
the boundary, and the checkpoint records the boundary's data position and RNG streams
(``checkpoint/state.py``), so ``--ckpt_path last`` after the fix repeats the failed loop step exactly.
Under DP a failure may be one rank's alone, and a save is a collective that the other ranks would
never join: only the scheduled checkpoints count there.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

from lightning.pytorch import Trainer

from lightning_grpo.checkpoint.signals import Preempted
from lightning_grpo.checkpoint.state import nonfinite_parameter

log = logging.getLogger(__name__)


def refusal(trainer: Trainer, save_failed: bool) -> str | None:
    """Why no emergency checkpoint may be written now (None: it may). ``save_failed``: a save of this fit failed."""
    at_boundary = getattr(trainer.lightning_module, "at_batch_boundary", False)
    # In this order: the non-finite check is a collective, never reached with several ranks.
    if trainer.world_size > 1:
        return "it runs on several ranks"
    if save_failed:
        return "a save had just failed"
    if not at_boundary:
        return "the update had already stepped"
    if nonfinite_parameter(trainer) is not None:
        return "parameters hold NaN/inf"
    return None


def failure_reason(exception: BaseException) -> str:
    """The manifest's ``reason``: the signal that ended the run, else the error's type."""
    signum = getattr(exception, "signum", None)
    if signum:
        return f"signal:{signal.Signals(signum).name}"
    return f"error:{type(exception).__name__}"


def report_refusal(loop_step: int, why: str, newest: Path | None) -> None:
    log.warning(
        "no emergency checkpoint of loop step %d (%s); the newest is %s",
        loop_step,
        why,
        newest,
    )


def report_saved(loop_step: int, path: Path | None, signum: int | None) -> None:
    """What the emergency save wrote, and how to go on: a signal's exit, else a resume after the fix."""
    if signum:
        log.warning("%s", Preempted(signum, path, loop_step))
        return
    log.warning(
        "emergency checkpoint of loop step %d (the last batch boundary): %s; after fixing the cause, "
        "resume with --ckpt_path last",
        loop_step,
        path,
    )
