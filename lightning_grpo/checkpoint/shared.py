"""A resume under several nodes: every rank must load the one checkpoint rank 0 resumes from.

Rank 0 writes the checkpoints; every rank loads the resumed one itself. A checkpoint folder on a disk only
rank 0's node sees (a relative ``dirpath`` resolved in each node's working folder, a node-local scratch)
makes ``--ckpt_path last`` find the file on rank 0 and nothing (or a stale copy) elsewhere: one rank
resumes while another starts from scratch, or dies on a missing file while the rest wait for it. The
ranks compare what they found once, right after the process group exists and before anything is
loaded, and all stop together with the folder named.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from lightning.pytorch import Trainer


class CheckpointNotSharedError(FileNotFoundError):
    """Some ranks cannot see the checkpoint rank 0 resumes from."""


def check_every_rank_sees(trainer: Trainer, resumed: str | os.PathLike | None) -> None:
    """Raise ``CheckpointNotSharedError`` on every rank unless all resume from rank 0's file (a collective)."""
    if trainer.world_size == 1:
        return
    mine = None if resumed is None else str(resumed)
    lead = trainer.strategy.broadcast(mine)
    sees = mine == lead and (lead is None or Path(lead).exists())
    flags = torch.tensor(
        [float(sees), float(trainer.node_rank)], device=trainer.strategy.root_device
    )
    # [world, (sees, node)]
    gathered = trainer.strategy.all_gather(flags).reshape(-1, 2).cpu()
    blind = [(r, int(node)) for r, (ok, node) in enumerate(gathered.tolist()) if not ok]
    if not blind:
        return
    who = ", ".join(f"rank {r} (node {n})" for r, n in blind)
    found = (
        f"resumes from {lead}, which {who} cannot see"
        if lead
        else f"found no checkpoint, but {who} found one"
    )
    raise CheckpointNotSharedError(
        f"checkpoint.dirpath: rank 0 {found}: the checkpoint folder is on a disk only some nodes see (a relative "
        "path is each node's own working folder). Put checkpoint.dirpath, or the logger's save_dir / "
        "trainer.default_root_dir, on a filesystem every node mounts at the same path"
    )
