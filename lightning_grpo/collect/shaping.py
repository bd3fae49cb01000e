"""Shaping a draw: which completion tokens of a collected batch count, and the overlong penalty.

Trained rows only count (a dynamic-sampling padding group or a skipped record's rows leave the loss and every
divisor), and under ``rl.mask_truncated_completions`` only completions that ended on EOS or a stop string. The
overlong penalty (DAPO's soft punishment) shapes rewards before the advantages. ``completion_metrics`` says what
the draw looked like and what shaping did to it.

A new rule is one function here, listed in ``REWARD_RULES`` (adds to every rollout's reward before the advantages)
or ``BATCH_METRICS`` (metrics over the collected batch): docs/collect.md shows one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from lightning_grpo.batch import RolloutBatch
from lightning_grpo.collect.groups import Groups
from lightning_grpo.config import GRPOConfig
from lightning_grpo.data.rewards import overlong_penalty
from lightning_grpo.metrics import length_metrics
from lightning_grpo.rollout.base import Rollout


def overlong_of(rollouts: list[Rollout], rl: GRPOConfig, max_new_tokens: int) -> Tensor:
    """``[N]`` the overlong penalty of each completion under ``rl.overlong_buffer`` / ``rl.overlong_penalty``."""
    # an episode's length is its model tokens: tool results are not the policy's verbosity
    lengths = torch.tensor(
        [
            len(r.token_ids) if r.model_mask is None else sum(r.model_mask)
            for r in rollouts
        ],
        dtype=torch.long,
    )
    return overlong_penalty(
        lengths, max_new_tokens, rl.overlong_buffer, rl.overlong_penalty
    )


def counted_only(
    batch: RolloutBatch, groups: Groups, mask_truncated: bool
) -> RolloutBatch:
    """``batch`` with completion tokens only on trained rows (and, under ``mask_truncated``, only on completions that
    ended on EOS or a stop string): the others leave the loss and every divisor. Their rewards already counted in
    their group's advantages (TRL's ``mask_truncated_completions``)."""
    counted = counted_rows(groups, mask_truncated)
    if bool(counted.all()):
        return batch
    return replace(batch, completion_mask=batch.completion_mask & counted[:, None])


def counted_rows(groups: Groups, mask_truncated: bool) -> Tensor:
    """``[N]`` bool: the rows whose completion tokens count in the loss (``counted_only``)."""
    if mask_truncated:
        return groups.trained & ~truncated(groups.rollouts)
    return groups.trained


def truncated(rollouts: list[Rollout]) -> Tensor:
    """``[N]`` bool: completions cut at ``max_new_tokens`` (finish reason ``length``), not ended by EOS or a stop."""
    return torch.tensor(
        [r.finish_reason == "length" for r in rollouts], dtype=torch.bool
    )


def described(groups: Groups) -> Tensor:
    """``[N]`` bool: the rows the batch's statistics describe: the trained ones (a dynamic-sampling padding group
    and a skipped record's placeholders left out), or, when nothing trains, every real row (as ``reward/*``)."""
    return groups.trained if bool(groups.trained.any()) else groups.live


def completion_metrics(
    groups: Groups, batch: RolloutBatch, rl: GRPOConfig, max_new_tokens: int
) -> dict[str, float]:
    """Lengths and endings of the trained completions (``described``), and what shaping did to them."""
    rows = described(groups)
    reasons = [
        r.finish_reason for r, kept in zip(groups.rollouts, rows.tolist()) if kept
    ]
    out = length_metrics(batch.completion_mask.sum(-1)[rows], reasons)
    if rl.overlong_buffer:
        out["reward/overlong_penalty_mean"] = float(
            overlong_of(groups.rollouts, rl, max_new_tokens)[rows].mean()
        )
    if rl.mask_truncated_completions:  # trained rows whose completion leaves the loss
        out["completion/truncated_masked"] = float(
            (truncated(groups.rollouts) & groups.trained).sum()
        )
    return out


RewardRule = Callable[[list[Rollout], GRPOConfig, int], Tensor]
"""``(rollouts, rl, max_new_tokens) -> [N]`` added to the rollouts' rewards (a penalty is negative)."""
BatchMetric = Callable[[Groups, RolloutBatch, GRPOConfig, int], dict[str, float]]
"""``(groups, batch, rl, max_new_tokens) -> metrics`` of one collected batch on this rank (mean over ranks)."""

REWARD_RULES: list[RewardRule] = [overlong_of]
"""Applied in order to every draw's rewards (round 0 and refills alike)."""
BATCH_METRICS: list[BatchMetric] = [completion_metrics]
"""Computed on every collected batch, after its advantages."""


def shape_rewards(
    rollouts: list[Rollout], rewards: Tensor, rl: GRPOConfig, max_new_tokens: int
) -> Tensor:
    """``[N]`` rewards with every rule of ``REWARD_RULES`` added."""
    for rule in REWARD_RULES:
        rewards = rewards + rule(rollouts, rl, max_new_tokens)
    return rewards


def batch_metrics(
    groups: Groups, batch: RolloutBatch, rl: GRPOConfig, max_new_tokens: int
) -> dict[str, float]:
    """Every metric of ``BATCH_METRICS`` over the collected batch."""
    out = {}
    for metric in BATCH_METRICS:
        out.update(metric(groups, batch, rl, max_new_tokens))
    return out
