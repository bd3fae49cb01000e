"""Version stamps: which weights drew each group, and how stale the trained rows were (``rollout/staleness*``).

Every group records the weight version (the loop step whose weights the engine held) at its first and at its last
sampled token: equal unless a weight update landed while the group was being sampled. A round drawn now carries the
trainer's version; a batch drawn ahead carries the version the engine held when it was put in flight
(``async_rollouts.py``). Refill rounds are drawn now, so under async rollouts one collected batch may mix versions:
the metrics are over the rows the loss learns from (refill rows included, padding groups left out), never one
figure per batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_grpo.rollout.base import Rollout


def stamps(rows: int, version: int) -> Tensor:
    """``[rows, 2]`` int64 (first, last token's version) of a round drawn with one weight version throughout."""
    return torch.full((rows, 2), version, dtype=torch.int64)


def drawn_stamps(rollouts: Sequence[Rollout], version: int, group_size: int) -> Tensor:
    """``[rows, 2]`` stamps of a round whose batch was put in flight with ``version``. Without per-token versions:
    ``stamps``. Under in-flight updates (``Rollout.versions``, in loop steps) a group's first token is the oldest
    version of its rows' first tokens (a request sent after a sync samples with the newer weights from its first
    token) and its last the newest version that sampled a token of the group."""
    out = stamps(len(rollouts), version)
    if all(r.versions is None for r in rollouts) or len(rollouts) % group_size:
        return out
    # [rows]
    first = torch.tensor(
        [(r.versions or [version])[0] for r in rollouts], dtype=torch.int64
    )
    # [rows]
    last = torch.tensor(
        [max(r.versions or [version]) for r in rollouts], dtype=torch.int64
    )
    # [G] -> [rows]
    out[:, 0] = first.view(-1, group_size).amin(1).repeat_interleave(group_size)
    out[:, 1] = last.view(-1, group_size).amax(1).repeat_interleave(group_size)
    return out


def token_staleness(
    rollouts: Sequence[Rollout], counted: Tensor, trainer_version: int
) -> dict[str, float]:
    """Under in-flight updates: the mean staleness of the counted rows' sampled tokens (each by the version that
    sampled it) and the fraction of them sampled after a sync cut their completion."""
    stale: list[int] = []
    cut: list[bool] = []
    for rollout, keep in zip(rollouts, counted.tolist()):
        if keep and rollout.versions:
            stale += [trainer_version - v for v in rollout.versions]
            cut += [v != rollout.versions[0] for v in rollout.versions]
    n = max(len(stale), 1)
    return {
        "rollout/token_staleness": sum(stale) / n,
        "rollout/inflight_tokens_frac": sum(cut) / n,
    }


def staleness_metrics(
    versions: Tensor, counted: Tensor, trainer_version: int, k: int
) -> dict[str, float]:
    """Staleness of the counted rows: loop steps between the weights at a row's first token and the trainer's.

    Args:
        versions: ``[N, 2]`` int64 (first, last) weight version of each row's group.
        counted: ``[N]`` bool, the rows described (the trained ones).
        trainer_version: the loop step whose weights the trainer holds now.
        k: ``rollout.max_off_policy_steps``: one ``staleness_<i>_frac`` per ``i`` in ``0..k``.
    """
    first = versions[counted, 0]  # [n]
    span = versions[counted, 1] - first  # [n] 0 unless an update landed mid-group
    stale = (trainer_version - first).double()  # [n]
    n = max(stale.numel(), 1)  # nothing counted: every figure 0
    out = {
        "rollout/staleness": float(stale.sum()) / n,
        "rollout/staleness_worst": float(stale.max()) if stale.numel() else 0.0,
        "rollout/version_span": float(span.max()) if span.numel() else 0.0,
    }
    for i in range(k + 1):
        out[f"rollout/staleness_{i}_frac"] = float((stale == i).sum()) / n
    return out
