"""Typed containers that carry tensors between modules.

Shapes use ``N`` for trajectories (prompts x group_size) and ``T`` for the padded
sequence length (prompt + completion, right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor


@dataclass(frozen=True)
class RolloutBatch:
    """One collected batch (this rank's share), ready for the update.

    Sequences are ``prompt + completion`` packed from position 0 and right-padded, so
    position ids are plain ``arange`` and trailing padding never influences a real token.

    Attributes:
        input_ids: ``[N, T]`` token ids.
        attention_mask: ``[N, T]`` bool, True on real (prompt or completion) tokens.
        completion_mask: ``[N, T]`` bool, True exactly on the tokens that count in the loss: the sampled ones (a
            multi-turn episode's tool and turn-separator tokens are False: holes inside the completion).
        advantages: ``[N]`` group-normalized advantage of each trajectory.
        rewards: ``[N]`` scalar reward of each trajectory (reporting only).
        group_ids: ``[N]`` int64 id of the prompt each trajectory answers.
        sample_ids: ``[N]`` int64 deterministic id of each trajectory.
        rollout_logprobs: ``[N, T]`` sampler logprob of each completion token (0 elsewhere), or None.
        images: per row, the image *references* of its prompt (``()`` for none), or None for a text-only batch.
            Never pixels: a chunk's pixels are materialized when it is scored (``vision.py``).
    """

    input_ids: Tensor
    attention_mask: Tensor
    completion_mask: Tensor
    advantages: Tensor
    rewards: Tensor
    group_ids: Tensor
    sample_ids: Tensor
    rollout_logprobs: Tensor | None = None
    images: tuple[tuple, ...] | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: Tensor | slice) -> RolloutBatch:
        """Rows ``rows`` of the batch, trimmed to their longest real sequence (saves memory, exact)."""
        picked = {f.name: _take(getattr(self, f.name), rows) for f in fields(self)}
        width = (
            int(picked["attention_mask"].sum(-1).max().item())
            if len(picked["input_ids"])
            else 0
        )
        # one target token at least, so logprob shapes never go empty
        width = max(width, 2)
        for name in (
            "input_ids",
            "attention_mask",
            "completion_mask",
            "rollout_logprobs",
        ):
            if picked[name] is not None:
                picked[name] = picked[name][:, :width]
        return RolloutBatch(**picked)

    def to(self, device: torch.device | str) -> RolloutBatch:
        return replace(
            self, **{f.name: _move(getattr(self, f.name), device) for f in fields(self)}
        )


def _take(t: Tensor | tuple | None, rows: Tensor | slice) -> Tensor | tuple | None:
    if isinstance(t, tuple):  # per-row references (images)
        return (
            t[rows] if isinstance(rows, slice) else tuple(t[i] for i in rows.tolist())
        )
    return None if t is None else t[rows]


def _move(
    t: Tensor | tuple | None, device: torch.device | str
) -> Tensor | tuple | None:
    return t.to(device) if isinstance(t, Tensor) else t


def pack_rollouts(
    rollouts,
    advantages: Tensor,
    rewards: Tensor,
    pad_id: int,
    max_len: int | None = None,
) -> RolloutBatch:
    """Pack ``prompt + completion`` of each rollout from position 0, right-padded to the longest.

    Args:
        rollouts: grouped rollouts (``Rollout`` from rollout/base.py), group after group.
        advantages: ``[N]``; rewards: ``[N]``.
        pad_id: token used for padding (never counted: masks are False there).
        max_len: refuse sequences longer than this (the model's context), naming the row.
    """
    seqs = [list(r.prompt.token_ids) + list(r.token_ids) for r in rollouts]
    if max_len is not None:
        _refuse_over_context(rollouts, seqs, max_len)
    n = len(seqs)
    width = max(max(len(s) for s in seqs), 2)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.bool)
    completion = torch.zeros((n, width), dtype=torch.bool)
    with_lp = all(r.logprobs is not None for r in rollouts)
    logprobs = torch.zeros((n, width), dtype=torch.float32) if with_lp else None
    for i, (r, s) in enumerate(zip(rollouts, seqs)):
        p = len(r.prompt.token_ids)
        input_ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attention[i, : len(s)] = True
        sampled = (
            torch.ones(len(s) - p, dtype=torch.bool)
            if r.model_mask is None
            else torch.tensor(r.model_mask)
        )
        # environment tokens of an episode: context, outside the loss
        completion[i, p : len(s)] = sampled
        if logprobs is not None and r.token_ids:
            logprobs[i, p : len(s)] = torch.tensor(
                r.logprobs, dtype=torch.float32
            ).masked_fill(~sampled, 0.0)
    group_ids = torch.tensor([r.prompt.id for r in rollouts], dtype=torch.long)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention,
        completion_mask=completion,
        advantages=advantages.to(torch.float32),
        rewards=rewards.to(torch.float32),
        group_ids=group_ids,
        sample_ids=_sample_ids(rollouts, group_ids),
        rollout_logprobs=logprobs,
        images=tuple(tuple(r.prompt.images) for r in rollouts)
        if any(r.prompt.images for r in rollouts)
        else None,
    )


def _refuse_over_context(rollouts, seqs: list[list[int]], max_len: int) -> None:
    """Name the first rollout whose ``prompt + completion`` is longer than the model's context."""
    for i, s in enumerate(seqs):
        if len(s) > max_len:
            raise ValueError(
                f"rollout {i} (prompt id {rollouts[i].prompt.id}) has {len(s)} tokens, over the "
                f"model context of {max_len}; lower rollout.max_new_tokens or the prompt length"
            )


def _sample_ids(rollouts, group_ids: Tensor) -> Tensor:
    """``[N]`` sample id = group_id * group_size + rank within the group: deterministic and unique."""
    seen: dict[int, int] = {}
    for r in rollouts:
        seen[r.prompt.id] = seen.get(r.prompt.id, 0) + 1
    group_size = max(seen.values())
    within = [0] * len(rollouts)
    for i, r in enumerate(rollouts):
        within[i] = group_size - seen[r.prompt.id]
        seen[r.prompt.id] -= 1
    return group_ids * group_size + torch.tensor(within, dtype=torch.long)
