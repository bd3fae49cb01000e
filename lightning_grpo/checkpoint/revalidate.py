"""A validation cut short (signal, kill -9) runs again when the run resumes from the checkpoint before it.

``GRPOCheckpoint`` publishes a loop step's checkpoint when the validation due after it starts, with
``validation: pending`` in its manifest, and marks it ``done`` when that validation ends. A resume from a
``pending`` checkpoint runs the validation before the first loop step.
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_grpo.checkpoint.integrity import DamagedCheckpointError, read_manifest


def validation_pending(ckpt_path) -> bool:
    """Whether the manifest of ``ckpt_path`` says the validation after its loop step never finished."""
    try:
        manifest = read_manifest(Path(ckpt_path))
    except (DamagedCheckpointError, OSError):
        return False
    return manifest is not None and manifest.validation == "pending"


def rerun_validation(trainer: Trainer) -> None:
    """Run the validation the resumed checkpoint's run never finished, before the first loop step.

    A checkpoint saved at the batch boundary precedes the validation due there; Lightning's restart treats that
    validation as done. Its restart path for a checkpoint written mid-validation re-runs it: this takes that path
    (the stage is Lightning's ``RestartStage``; the counters of the last validation are cleared, or the re-run would
    count them as already fetched and stop after one batch).
    """
    try:
        from lightning.pytorch.loops.evaluation_loop import RestartStage
    except ImportError:  # older Lightning: no mid-validation restart
        rank_zero_warn(
            "the validation after the resumed checkpoint's loop step was interrupted and this Lightning "
            "cannot re-run it (needs lightning>=2.5); it is skipped"
        )
        return
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    val_loop.batch_progress.current.reset()
    val_loop._restart_stage = RestartStage.RESTARTED_MID_EVALUATION
    rank_zero_info(
        "the validation after the resumed loop step was interrupted: running it again first"
    )
