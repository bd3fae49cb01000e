"""Whole groups of one draw: ``group_size`` contiguous rows per prompt, with which rows are real and which train.

What dynamic sampling's refill (``refill.py``) keeps and drops, and what shaping (``shaping.py``) masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_grpo.rollout.base import Rollout


@dataclass(frozen=True)
class Groups:
    """Whole groups of one draw, ``group_size`` contiguous rows each (``N = groups x group_size``)."""

    rollouts: list[Rollout]
    """``[N]`` completions, prompt 0's group first."""
    rewards: Tensor
    """``[N]`` float32 rewards (shaped: the overlong penalty is in)."""
    live: Tensor
    """``[N]`` bool: rows with a real completion (False: a skipped bad record's placeholder)."""
    trained: Tensor
    """``[N]`` bool: rows the loss learns from (live, and not a padding group under dynamic sampling)."""
    versions: Tensor
    """``[N, 2]`` int64: the weight version at the first and at the last sampled token of each row's group
    (``staleness.py``)."""

    def group(self, g: int, group_size: int, trained: bool) -> Groups:
        rows = slice(g * group_size, (g + 1) * group_size)
        live = self.live[rows]
        return Groups(
            self.rollouts[rows],
            self.rewards[rows],
            live,
            live & trained,
            self.versions[rows],
        )


def concat(groups: list[Groups]) -> Groups:
    return Groups(
        [r for g in groups for r in g.rollouts],
        torch.cat([g.rewards for g in groups]),
        torch.cat([g.live for g in groups]),
        torch.cat([g.trained for g in groups]),
        torch.cat([g.versions for g in groups]),
    )


def scatter(values: Tensor, keep: Tensor) -> Tensor:
    """``[len(keep)]``: ``values`` at the kept rows, 0 at the others."""
    out = values.new_zeros(keep.shape)
    out[keep] = values
    return out
