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
        completion_mask: ``[N, T]`` bool, True exactly on the tokens that count in the loss.
        advantages: ``[N]`` group-normalized advantage of each trajectory.
        rewards: ``[N]`` scalar reward of each trajectory (reporting only).
        group_ids: ``[N]`` int64 id of the prompt each trajectory answers.
        sample_ids: ``[N]`` int64 deterministic id of each trajectory.
        rollout_logprobs: ``[N, T]`` sampler logprob of each completion token (0 elsewhere), or None.
    """

    input_ids: Tensor
    attention_mask: Tensor
    completion_mask: Tensor
    advantages: Tensor
    rewards: Tensor
    group_ids: Tensor
    sample_ids: Tensor
    rollout_logprobs: Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: Tensor | slice) -> RolloutBatch:
        """Rows ``rows`` of the batch, trimmed to their longest real sequence (saves memory, exact)."""
        picked = {f.name: _take(getattr(self, f.name), rows) for f in fields(self)}
        width = int(picked["attention_mask"].sum(-1).max().item()) if len(picked["input_ids"]) else 0
        width = max(width, 2)  # one target token at least, so logprob shapes never go empty
        for name in ("input_ids", "attention_mask", "completion_mask", "rollout_logprobs"):
            if picked[name] is not None:
                picked[name] = picked[name][:, :width]
        return RolloutBatch(**picked)

    def to(self, device: torch.device | str) -> RolloutBatch:
        return replace(self, **{f.name: _move(getattr(self, f.name), device) for f in fields(self)})


def _take(t: Tensor | None, rows: Tensor | slice) -> Tensor | None:
    return None if t is None else t[rows]


def _move(t: Tensor | None, device: torch.device | str) -> Tensor | None:
    return None if t is None else t.to(device)
