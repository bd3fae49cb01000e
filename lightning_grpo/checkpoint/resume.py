"""``--ckpt_path last``: which checkpoint a trainer resumes from.

The folders searched come from the trainer's ``GRPOCheckpoint`` callbacks (or its log folders); which
file of them is the newest intact one of the right lineage is ``paths.resolve_last``'s rule.
"""

from __future__ import annotations

import logging
import os
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_grpo.checkpoint.callback import GRPOCheckpoint
from lightning_grpo.checkpoint.integrity import DamagedCheckpointError
from lightning_grpo.checkpoint.paths import LATEST, entries, resolve_last

log = logging.getLogger(__name__)


def search_dirs(trainer: Trainer, roots: Sequence[Path] = ()) -> list[Path]:
    """Where ``last`` looks: each GRPOCheckpoint's explicit dirpath, else ``checkpoints/`` of every run version
    under the logger's root (``roots`` instead where given: a W&B logger has none, ``run_folder.version_wandb_logger``
    names its experiment's folder)."""
    explicit = [
        cb.dirpath
        for cb in trainer.callbacks
        if isinstance(cb, GRPOCheckpoint) and cb.explicit_dirpath
    ]
    if explicit:
        return explicit
    if not roots:
        roots = [
            Path(getattr(trainer.logger, "root_dir", None) or trainer.default_root_dir)
        ]
    return [
        d
        for root in map(Path, roots)
        for d in (root / "checkpoints", *sorted(root.glob("*/checkpoints")))
    ]


def resolve_ckpt_path(
    ckpt_path: str | os.PathLike | None, trainer: Trainer, roots: Sequence[Path] = ()
) -> str | os.PathLike | None:
    """``"last"`` -> the newest intact checkpoint of the latest lineage (None, with a warning, when there is none),
    searched under ``roots`` (``search_dirs``) where given.

    A trainer whose ``GRPOCheckpoint`` already belongs to a lineage (a second ``fit``) resumes that lineage.
    Any other value is returned unchanged (the CLI checks it first: ``check_ckpt_file``).
    """
    resolved = _resolve(ckpt_path, trainer, roots)
    for cb in trainer.callbacks:
        if isinstance(cb, GRPOCheckpoint):
            # compared over ranks before anything loads (checkpoint/shared.py)
            cb.resume_from(resolved)
    return resolved


def _resolve(
    ckpt_path: str | os.PathLike | None, trainer: Trainer, roots: Sequence[Path]
) -> str | os.PathLike | None:
    if ckpt_path != "last":
        return ckpt_path
    dirs = search_dirs(trainer, roots)
    own = next(
        (
            cb.lineage
            for cb in trainer.callbacks
            if isinstance(cb, GRPOCheckpoint) and cb.lineage
        ),
        LATEST,
    )
    found = resolve_last(dirs, own)
    if found is None:  # like Lightning: "last" may be set before the first run of a job
        log.warning(
            "ckpt_path='last': no complete checkpoint under %s; starting from scratch",
            ", ".join(str(d) for d in dirs),
        )
        return None
    others = sorted(
        {e.lineage or "(no id)" for e in entries(dirs)} - {found.lineage or "(no id)"}
    )
    saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(found.saved_at / 1e9))
    rank_zero_info(
        f"ckpt_path='last': resuming run {found.lineage or '(no id)'} from {found.path} (loop step "
        f"{found.loop_step}, saved {saved})"
        + (f"; the folder also holds run(s) {', '.join(others)}" if others else "")
    )
    return str(found.path)


class CheckpointPathError(FileNotFoundError):
    """``--ckpt_path`` names nothing on disk."""


def check_ckpt_file(ckpt_path: str | os.PathLike) -> str | os.PathLike:
    """Refuse, naming the file, a ``ckpt_path`` that is missing or is not a ``torch.save`` archive.

    Before the model is built and before Lightning's ``torch.load``, whose errors name neither the file nor the
    fix (``Invalid argument``, ``Unsupported operand 110``). Only the zip header is read: a damaged file whose
    header survived is caught by its manifest (``integrity.py``). A folder (a sharded checkpoint) passes.
    """
    path = Path(ckpt_path).expanduser()
    fix = "Give a checkpoint file a fit wrote (<log dir>/checkpoints/*.ckpt), or --ckpt_path=last for the newest intact one"
    if not path.exists():
        raise CheckpointPathError(
            f"--ckpt_path={ckpt_path}: no such file or folder. {fix}"
        )
    if path.is_file() and not zipfile.is_zipfile(path):
        raise DamagedCheckpointError(
            f"--ckpt_path={ckpt_path}: not a PyTorch checkpoint ({path.stat().st_size} bytes, "
            f"not the zip archive torch.save writes): damaged or another kind of file. {fix}"
        )
    return ckpt_path
