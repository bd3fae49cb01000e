"""The policy's entropy in the GRPO loss: an optional bonus, and the top-entropy token mask (Wang et al. 2025).

Both are exact under any chunk split: the bonus is one more per-token term under the loss's own divisor, and the mask
is chosen per sequence (a chunk always holds whole rows), never from a threshold over the chunk or the batch.
"""

from __future__ import annotations

import torch
from torch import Tensor


def top_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """``[B, T-1]`` 1.0 on each row's ``ceil(quantile * n_i)`` highest-entropy counted tokens, 0 elsewhere.

    "Beyond the 80/20 rule" (arXiv 2506.01939; TRL ``top_entropy_quantile``) thresholds over the whole batch; a batch
    or chunk threshold would move with the chunking, so each sequence keeps its own top share instead. Ties at a
    row's threshold are all kept. The entropy is detached: the mask selects tokens, it carries no gradient.

    Args:
        entropy: ``[B, T-1]`` per-token entropy of the policy.
        mask: ``[B, T-1]`` bool, True on tokens that count.
        quantile: the share of each row's tokens kept, in (0, 1].
    """
    ent = entropy.detach()
    # [B, T-1]
    ranked = ent.masked_fill(~mask, float("-inf")).sort(-1, descending=True).values
    # the 1e-9 keeps a product like 0.2 * 5 = 1.0000000000000002 from rounding up to 2
    # [B, 1]
    keep = (
        (mask.sum(-1, keepdim=True).double() * quantile - 1e-9)
        .ceil()
        .long()
        .clamp(min=1)
    )
    # [B, 1]: the row's k-th largest
    threshold = ranked.gather(-1, keep.clamp(max=max(ranked.shape[-1], 1)) - 1)
    return ((ent >= threshold) & mask).to(entropy.dtype)


def token_mean(entropy: Tensor | None, m: Tensor, tokens: Tensor) -> Tensor:
    """Token mean of the entropy over this rank's counted tokens (NaN when the policy view could not measure it)."""
    if entropy is None:
        return torch.full((), float("nan"), dtype=tokens.dtype)
    return (entropy.detach() * m).sum() / tokens.clamp(min=1)
