"""``--ckpt_path last``: which checkpoint a trainer resumes from.

The folders searched come from the trainer's ``GRPOCheckpoint`` callbacks (or its log folders); which
file of them is the newest intact one of the right lineage is ``paths.resolve_last``'s rule.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_grpo.checkpoint.callback import GRPOCheckpoint
from lightning_grpo.checkpoint.paths import LATEST, entries, resolve_last

log = logging.getLogger(__name__)


def search_dirs(trainer: Trainer) -> list[Path]:
    """Where ``last`` looks: each GRPOCheckpoint's explicit dirpath, else ``checkpoints/`` of every run version."""
    explicit = [cb.dirpath for cb in trainer.callbacks if isinstance(cb, GRPOCheckpoint) and cb.explicit_dirpath]
    if explicit:
        return explicit
    logger = trainer.logger
    root = Path(getattr(logger, "root_dir", None) or trainer.default_root_dir)
    return [root / "checkpoints", *sorted(root.glob("*/checkpoints"))]


def resolve_ckpt_path(ckpt_path: str | os.PathLike | None, trainer: Trainer) -> str | os.PathLike | None:
    """``"last"`` -> the newest intact checkpoint of the latest lineage (None, with a warning, when there is none).

    A trainer whose ``GRPOCheckpoint`` already belongs to a lineage (a second ``fit``) resumes that lineage.
    Any other value is returned unchanged.
    """
    if ckpt_path != "last":
        return ckpt_path
    dirs = search_dirs(trainer)
    own = next((cb.lineage for cb in trainer.callbacks if isinstance(cb, GRPOCheckpoint) and cb.lineage), LATEST)
    found = resolve_last(dirs, own)
    if found is None:  # like Lightning: "last" may be set before the first run of a job
        log.warning("ckpt_path='last': no complete checkpoint under %s; starting from scratch",
                    ", ".join(str(d) for d in dirs))
        return None
    others = sorted({e.lineage or "(no id)" for e in entries(dirs)} - {found.lineage or "(no id)"})
    saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(found.saved_at / 1e9))
    rank_zero_info(f"ckpt_path='last': resuming run {found.lineage or '(no id)'} from {found.path} (loop step "
                   f"{found.loop_step}, saved {saved})"
                   + (f"; the folder also holds run(s) {', '.join(others)}" if others else ""))
    return str(found.path)
