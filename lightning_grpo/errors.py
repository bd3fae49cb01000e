"""Errors a user causes after the config loaded: which they are, and where their traceback is kept.

A reward function that raises, a ``--ckpt_path`` that is missing or damaged, a ``policy.path`` that is not a
model: each is raised as one of ``USER_ERRORS``, with a message naming the cause, the knob or file, and the fix.
The CLI prints that message in a few lines (``cli_errors.config_error``) instead of a 20-100 line traceback whose
last line is the message. Nothing is lost: the full traceback goes to ``error.log`` in the run folder (when the
run got one), and ``LIGHTNING_GRPO_DEBUG=1`` raises it as is. Any other exception is a bug: its traceback shows.

A full disk (or a quota, ``ulimit -f``, a read-only folder) while a run file is written (completions.jsonl,
metrics.csv, curves.png, the summary, a checkpoint) is the user's to fix too: ``write_failed`` turns that
``OSError`` into a ``RunWriteError`` naming the file and the checkpoint to resume from. The checkpoint callback has
saved the last batch boundary by then (its emergency save, as for any error inside a loop step).
"""

from __future__ import annotations

import errno
import traceback
from pathlib import Path

from lightning.pytorch import Trainer

from lightning_grpo.certificate import ConsistencyError
from lightning_grpo.checkpoint import (
    DamagedCheckpointError,
    FolderInUseError,
    GRPOCheckpoint,
    NonFiniteParametersError,
    find_last_checkpoint,
)
from lightning_grpo.checkpoint.identity import ResumeMismatchError
from lightning_grpo.checkpoint.resume import CheckpointPathError
from lightning_grpo.checkpoint.shared import CheckpointNotSharedError
from lightning_grpo.data.images import BadImageError
from lightning_grpo.data.reward_calls import RewardError
from lightning_grpo.envs.environment import EnvProtocolError
from lightning_grpo.policy import PolicyNotFoundError
from lightning_grpo.rollout.server.http_json import ServerError
from lightning_grpo.rollout.server.probe import StaleEngineError
from lightning_grpo.rollout.vllm_loadable import EngineCannotLoadError
from lightning_grpo.update.loop import NonFiniteRunError

WRITE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}
)
"""An ``OSError`` with one of these while writing is the disk's, not a bug (EFBIG: ``ulimit -f``)."""


class RunWriteError(OSError):
    """A run file could not be written (disk full, quota, file size limit, read-only); the message says the fix.

    ``cli_errors.config_error`` prints this message, not its cause's (the raw ``OSError``, the innermost of the chain)."""

    def __str__(self) -> str:
        return self.strerror  # the message names the errno already


USER_ERRORS = (
    RewardError,
    CheckpointPathError,
    DamagedCheckpointError,
    PolicyNotFoundError,
    NonFiniteRunError,
    NonFiniteParametersError,
    FolderInUseError,
    ResumeMismatchError,
    EngineCannotLoadError,
    RunWriteError,
    EnvProtocolError,
    ConsistencyError,
    ServerError,
    StaleEngineError,
    CheckpointNotSharedError,
    BadImageError,
)
"""Raised mid-run for something the user can fix; their messages say what and how."""
ERROR_LOG = "error.log"


def write_failed(err: BaseException, trainer: Trainer | None) -> RunWriteError | None:
    """``err`` as a ``RunWriteError`` when it is (or was caused by) a failed write of the disk's making, else None.

    The message names the file (or the run folder, when the writer did not say which file), the errno's words, the
    loop step the run stopped at and the newest checkpoint of this run, from which ``--ckpt_path=last`` resumes.
    """
    cause = _write_cause(err)
    if cause is None or trainer is None:
        return None
    folder = (
        getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
    )
    what = (
        cause.filename
        or f"a file of the run folder {folder or trainer.default_root_dir}"
    )
    saver = next(
        (cb for cb in trainer.callbacks if isinstance(cb, GRPOCheckpoint)), None
    )
    newest = (
        find_last_checkpoint([saver.dirpath], saver.lineage)
        if saver and saver.dirpath
        else None
    )
    step = getattr(trainer.lightning_module, "loop_step", None)
    at = f" after loop step {step}" if isinstance(step, int) else ""
    saved = (
        f"its newest checkpoint: {newest}"
        if newest is not None
        else "it has no checkpoint (trainer.enable_checkpointing=true keeps the batch boundaries)"
    )
    return RunWriteError(
        cause.errno,
        f"could not write {what}: [Errno {cause.errno}] {cause.strerror}\n"
        f"  the run stopped{at}; {saved}\n"
        "  free space (or move the run: trainer.logger.init_args.save_dir), then resume with "
        "--ckpt_path=last",
    )


def _write_cause(err: BaseException) -> OSError | None:
    """The first ``OSError`` of ``WRITE_ERRNOS`` in ``err``'s chain (a failed cleanup may have followed it)."""
    seen = []
    while err is not None and err not in seen:
        if isinstance(err, RunWriteError):
            return None  # already reported
        if isinstance(err, OSError) and err.errno in WRITE_ERRNOS:
            return err
        seen.append(err)
        err = err.__cause__ or err.__context__
    return None


def logged_error(trainer: Trainer | None, err: BaseException) -> BaseException:
    """What the CLI reports for ``err`` (a ``RunWriteError`` for a failed write, else ``err``), its traceback logged
    to ``error.log`` and named in a note."""
    log = write_error_log(trainer, err)  # None on a full disk
    reported = write_failed(err, trainer) or err
    if log is not None:
        reported.add_note(f"full traceback: {log}")  # the short report names the file
    return reported


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
    try:
        with path.open("a", encoding="utf-8") as f:
            f.write("".join(traceback.format_exception(err)))
    # a full disk: the error being reported must not be replaced by this one
    except OSError:
        return None
    return path
