"""The GRPO objective: clipped surrogate against pi_old, optional k3 KL, token-mean loss.

Tensors in, ``(loss, denom, stats)`` out. ``loss`` is the chunk's own token mean and
``denom`` the divisor it used (the DP mean of masked completion tokens), so the
accumulator can recover the chunk sum as ``loss * denom`` and defer the batch division
to the optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from lightning_grpo.batch import RolloutBatch
from lightning_grpo.distributed import single_process
from lightning_grpo.objectives.base import PolicyView, Reduction

# Reduces a scalar tensor to its mean over data-parallel ranks (identity on one device).
DPMean = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class ChunkStats:
    """What one chunk reports, as 0-d tensors: the roll-up moves them to the host in one sync."""

    REDUCE: ClassVar[dict[str, Reduction]] = {
        "loss": ("grpo/loss", "denom"), "denom": ("grpo/denom", "sum"), "tokens": ("grpo/tokens", "sum"),
        "n": ("grpo/n", "sum"), "clip_frac": ("grpo/clip_frac", "tokens"), "ratio_mean": ("grpo/ratio_mean", "tokens"),
        "ratio_max": ("grpo/ratio_max", "max"), "kl": ("grpo/kl", "tokens"), "kl_old": ("grpo/kl_old", "tokens"),
    }
    """Field -> (metric, reduction): the loss weighted by the divisor, per-token figures by this rank's tokens."""

    loss: Tensor
    denom: Tensor
    """Divisor the loss was normalized by (DP-mean masked completion tokens)."""
    tokens: Tensor
    """This rank's masked completion tokens."""
    n: Tensor
    """Trajectories in the chunk."""
    clip_frac: Tensor
    """Fraction of this rank's tokens whose ratio was clipped."""
    ratio_mean: Tensor
    """Token mean of the ratio over this rank's tokens."""
    ratio_max: Tensor
    """Largest ratio on a counted token (-inf on an empty chunk)."""
    kl: Tensor
    """Token mean of the k3 KL (0 when beta == 0)."""
    kl_old: Tensor | None = None
    """Token mean of the k3 estimate of KL(pi_old || pi): how far the policy moved from the one that sampled."""


class GRPOObjective:
    """Clipped surrogate (PPO-style, per token) with an optional k3 KL penalty.

    Args:
        epsilon: lower clip range (ratio >= 1 - epsilon).
        epsilon_high: upper clip range (ratio <= 1 + epsilon_high).
        beta: KL weight; 0 skips the KL term (no reference logprobs needed).
        dp_mean: all-reduce mean over data-parallel ranks for the divisor.
    """

    name = "grpo"
    stats = ChunkStats  # names every grpo/* figure of a loop step where no chunk stepped

    def __init__(self, epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
                 dp_mean: DPMean = single_process) -> None:
        self.epsilon = epsilon
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high
        self.beta = beta
        self.dp_mean = dp_mean

    def needs_old_logprobs(self) -> bool:
        """The ratio consumes pi_old, so mini-batching needs it frozen (the ahead pass)."""
        return True

    def needs_reference(self) -> bool:
        """The k3 KL needs the frozen initial policy; beta == 0 builds none."""
        return self.beta > 0

    def setup(self, policy: nn.Module, tokenizer) -> None:
        """Nothing to build."""

    def chunk_loss(self, chunk: RolloutBatch, policy: PolicyView,
                   old_logprobs: Tensor | None) -> tuple[Tensor, Tensor, ChunkStats]:
        """Score ``chunk`` with the policy (and the reference when beta > 0), then the loss below."""
        logprobs = policy.logprobs(chunk)
        ref = policy.reference(chunk) if self.beta > 0 and policy.reference is not None else None
        return self(logprobs, chunk.completion_mask[:, 1:], chunk.advantages, old_logprobs, ref)

    def __call__(
        self,
        logprobs: Tensor,
        mask: Tensor,
        advantages: Tensor,
        old_logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, ChunkStats]:
        """Loss of one chunk.

        Args:
            logprobs: ``[B, T-1]`` current per-token logprobs (with grad).
            mask: ``[B, T-1]`` bool, True on tokens that count.
            advantages: ``[B]``.
            old_logprobs: ``[B, T-1]`` pi_old; None = ``logprobs.detach()`` (exact when nothing moved).
            ref_logprobs: ``[B, T-1]`` reference policy, required when beta > 0.
        """
        old = logprobs.detach() if old_logprobs is None else old_logprobs
        m = mask.to(logprobs.dtype)
        ratio = torch.exp(logprobs - old)  # [B, T-1]
        adv = advantages.to(logprobs.dtype).unsqueeze(-1)  # [B, 1]
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
        per_token = -torch.min(ratio * adv, clipped * adv)
        kl = torch.zeros_like(per_token)
        if self.beta > 0:
            if ref_logprobs is None:
                raise ValueError("GRPOObjective(beta>0) needs ref_logprobs; build the module with a reference model")
            delta = ref_logprobs - logprobs
            kl = torch.exp(delta) - delta - 1  # k3 estimator: unbiased, always >= 0
            per_token = per_token + self.beta * kl
        tokens = m.sum()
        denom = self.dp_mean(tokens.detach())
        # Guard zero only: an all-masked chunk has denom 0 and loss 0, never 0/0. Under DP the divisor is a mean and
        # may be in (0, 1) (fewer tokens than ranks); clamping it to 1 would make loss * denom differ from the chunk sum.
        loss = (per_token * m).sum() / torch.where(denom > 0, denom, torch.ones_like(denom))
        with torch.no_grad():
            is_clipped = ((ratio * adv) > (clipped * adv)).to(m.dtype) * m  # the min picked the clipped term
            local = tokens.clamp(min=1)
            stats = ChunkStats(
                loss=loss.detach(),
                denom=denom,
                tokens=tokens,
                n=torch.tensor(float(mask.shape[0]), dtype=torch.float32),  # 16-true sets a half default dtype
                clip_frac=is_clipped.sum() / local,
                ratio_mean=(ratio * m).sum() / local,
                ratio_max=ratio.detach().masked_fill(~mask, float("-inf")).amax() if mask.numel() else tokens * 0,
                kl=(kl * m).sum() / local,
                kl_old=((ratio - 1 - (logprobs - old)) * m).sum() / local,  # k3, r = pi / pi_old
            )
        return loss, denom, stats
