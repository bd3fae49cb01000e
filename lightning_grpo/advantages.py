"""Group-relative advantages: each completion's reward against its own group's.

Rows are grouped contiguously, as the engines return them: group ``g`` is rows
``g*G .. (g+1)*G - 1`` of the ``[N]`` reward vector (``N = prompts x G``).

Standard deviations are *unbiased* (Bessel's correction, ``correction=1``) everywhere
in this module, as in the GRPO paper's reference code and TRL, so advantages match
theirs for the same rewards. ``group_size >= 2`` (enforced by the config) keeps the
unbiased group std defined.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Scale = Literal["group", "batch", "none"]
SCALES = ("group", "batch", "none")


def group_advantages(
    rewards: Tensor,
    group_size: int,
    scale: Scale = "group",
    eps: float = 1e-4,
    batch_std: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Advantages ``(r - mean_group) / (std + eps)`` and the reward statistics of the batch.

    Args:
        rewards: ``[N]`` reward of each completion, ``N`` a multiple of ``group_size``, groups contiguous.
        group_size: completions per prompt (``G``).
        scale: ``"group"`` divides by each group's std, ``"batch"`` by the std of all ``N`` rewards,
            ``"none"`` only centres (``r - mean_group``, Dr. GRPO style).
        eps: added to the std so a zero-variance group gives advantage 0, not NaN.
        batch_std: the std to use for ``scale="batch"`` instead of the std of ``rewards``; pass the
            std of the all-gathered rewards to scale every data-parallel rank by the global batch.

    Returns:
        ``(advantages [N] float32, stats)``; ``stats`` holds 0-dim tensors (no host sync here):
        ``reward/mean``, ``reward/std`` (of the ``N`` rewards), ``reward/min``, ``reward/max``,
        ``reward/group_std`` (mean over groups) and ``reward/frac_zero_std`` (fraction of groups
        whose rewards are all equal, so every advantage in them is 0 and they teach nothing).
    """
    _check(rewards, group_size, scale)
    r = rewards.detach().float()
    grouped = r.view(-1, group_size)  # [P, G]
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)  # [N]
    group_std = grouped.std(dim=1, correction=1)  # [P]
    if scale == "group":
        advantages = centred / (group_std.repeat_interleave(group_size) + eps)
    elif scale == "batch":
        std = (
            r.std(correction=1)
            if batch_std is None
            else torch.as_tensor(batch_std, dtype=r.dtype)
        )
        advantages = centred / (std + eps)
    else:
        advantages = centred
    return advantages, _stats(r, grouped, group_std)


def _stats(r: Tensor, grouped: Tensor, group_std: Tensor) -> dict[str, Tensor]:
    # "Zero std" is tested as max == min, not std == 0: the float std of equal values can come out 1e-17.
    zero_std = grouped.amax(dim=1) == grouped.amin(dim=1)  # [P]
    return {
        "reward/mean": r.mean(),
        "reward/std": r.std(correction=1) if r.numel() > 1 else r.new_zeros(()),
        "reward/min": r.min(),
        "reward/max": r.max(),
        "reward/group_std": group_std.mean(),
        "reward/frac_zero_std": zero_std.float().mean(),
    }


def _check(rewards: Tensor, group_size: int, scale: str) -> None:
    if scale not in SCALES:
        raise ValueError(
            f"scale={scale!r}: must be one of {', '.join(map(repr, SCALES))}"
        )
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"group_size={group_size!r}: must be an integer >= 2 (a group of one has no relative advantage)"
        )
    if rewards.dim() != 1 or rewards.numel() == 0 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)}: must be a non-empty [N] vector with N a multiple of "
            f"group_size={group_size} (groups of contiguous rows)"
        )


def dp_batch_std(rewards: Tensor, all_reduce) -> Tensor:
    """``scale_rewards="batch"`` under DP: the unbiased std of every rank's rewards (``all_reduce(t, "sum")``)."""
    r = rewards.detach().double()
    total, squares, n = all_reduce(
        torch.stack([r.sum(), r.square().sum(), r.new_tensor(r.numel())]), "sum"
    )
    return ((squares - total * total / n).clamp(min=0) / (n - 1)).sqrt().float()
