"""The objectives/ unit tier: one chunk's tensors, unequal lengths, float64, so a wrong divisor shows."""

from dataclasses import dataclass

import pytest
import torch


@dataclass(frozen=True)
class ChunkTensors:
    """What an objective reads of one chunk: ``[B, T-1]`` logprobs (with grad), pi_old, mask; ``[B]`` advantages."""

    logprobs: torch.Tensor
    old: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor


@pytest.fixture
def chunk_tensors():
    """5 rows of 3, 9, 1, 6 and 0 counted tokens (width 10): pi_old 0.3 nats away at most, so ratios clip."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 9, 1, 6, 0])
    mask = torch.arange(10)[None, :] < lengths[:, None]
    logprobs = (-torch.rand(5, 10, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    old = logprobs.detach() + (torch.rand(5, 10, generator=gen, dtype=torch.float64) - 0.5) * 0.6
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.7], dtype=torch.float64)
    return ChunkTensors(logprobs, old, mask, advantages)
