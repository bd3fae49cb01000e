"""Errors a user causes after the config loaded: which they are, and where their traceback is kept.

A reward function that raises, a ``--ckpt_path`` that is missing or damaged, a ``policy.path`` that is not a
model: each is raised as one of ``USER_ERRORS``, with a message naming the cause, the knob or file, and the fix.
The CLI prints that message in a few lines (``cli.config_error``) instead of a 20-100 line traceback whose
last line is the message. Nothing is lost: the full traceback goes to ``error.log`` in the run folder (when the
run got one), and ``LIGHTNING_GRPO_DEBUG=1`` raises it as is. Any other exception is a bug: its traceback shows.
"""

from __future__ import annotations

import traceback
from pathlib import Path

from lightning.pytorch import Trainer

from lightning_grpo.checkpoint import DamagedCheckpointError, FolderInUseError, NonFiniteParametersError
from lightning_grpo.checkpoint.identity import ResumeMismatchError
from lightning_grpo.checkpoint.resume import CheckpointPathError
from lightning_grpo.data.images import BadImageError
from lightning_grpo.data.reward_calls import RewardError
from lightning_grpo.policy import PolicyNotFoundError
from lightning_grpo.rollout.server.process import ServerError
from lightning_grpo.rollout.vllm_loadable import EngineCannotLoadError
from lightning_grpo.update.loop import NonFiniteRunError

USER_ERRORS = (RewardError, CheckpointPathError, DamagedCheckpointError, PolicyNotFoundError, NonFiniteRunError,
               NonFiniteParametersError, FolderInUseError, ResumeMismatchError, EngineCannotLoadError, ServerError,
               BadImageError)
"""Raised mid-run for something the user can fix; their messages say what and how."""
ERROR_LOG = "error.log"


def write_error_log(trainer: Trainer | None, err: BaseException) -> Path | None:
    """Append ``err``'s full traceback to ``error.log`` in the run folder (rank 0); the path, or None without one.

    Reads the logger's own folder (no ``trainer.log_dir``: that is a collective, and one rank may fail alone) and
    never creates it: a run that failed before logging anything leaves no folder behind.
    """
    if trainer is None or not trainer.is_global_zero or trainer.logger is None:
        return None
    folder = getattr(trainer.logger, "log_dir", None) or trainer.logger.save_dir
    if folder is None or not Path(folder).is_dir():
        return None
    path = Path(folder) / ERROR_LOG
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(traceback.format_exception(err)))
    return path
