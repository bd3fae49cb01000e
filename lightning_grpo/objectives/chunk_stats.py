"""What a GRPO chunk reports (``ChunkStats``), and the rollout correction's figures on top
(``CorrectedChunkStats``): 0-d tensors, each field with its roll-up reduction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from lightning_grpo.objectives.base import Reduction


@dataclass(frozen=True)
class ChunkStats:
    """What one chunk reports, as 0-d tensors: the roll-up moves them to the host in one sync."""

    REDUCE: ClassVar[dict[str, Reduction]] = {
        "loss": ("grpo/loss", "denom"),
        "denom": ("grpo/denom", "sum"),
        "tokens": ("grpo/tokens", "sum"),
        "n": ("grpo/n", "sum"),
        "clip_frac": ("grpo/clip_frac", "tokens"),
        "ratio_mean": ("grpo/ratio_mean", "tokens"),
        "ratio_max": ("grpo/ratio_max", "max"),
        "kl": ("grpo/kl", "tokens"),
        "kl_old": ("grpo/kl_old", "tokens"),
        "clip_frac_low": ("grpo/clip_frac_low", "tokens"),
        "clip_frac_high": ("grpo/clip_frac_high", "tokens"),
        "seqs": ("grpo/seqs", "sum"),
        "entropy": ("grpo/entropy", "tokens"),
    }
    """Field -> (metric, reduction): the loss weighted by the divisor, per-token figures by this rank's tokens."""

    loss: Tensor
    denom: Tensor
    """Divisor the loss was normalized by (a DP mean: completion tokens, sequences, or sequences x max length)."""
    tokens: Tensor
    """This rank's masked completion tokens."""
    n: Tensor
    """Trajectories in the chunk."""
    clip_frac: Tensor
    """Fraction of this rank's tokens whose ratio was clipped (low + high)."""
    ratio_mean: Tensor
    """Token mean of the ratio over this rank's tokens (a sequence ratio counts once per token of its sequence)."""
    ratio_max: Tensor
    """Largest ratio on a counted token (-inf on an empty chunk)."""
    kl: Tensor
    """Token mean of the k3 KL (0 when beta == 0)."""
    kl_old: Tensor | None = None
    """Token mean of the k3 estimate of KL(pi_old || pi): how far the policy moved from the one that sampled."""
    clip_frac_low: Tensor | None = None
    """Fraction of tokens clipped below (ppo_clip: ratio < 1 - epsilon and A < 0; cispo: weight truncated below)."""
    clip_frac_high: Tensor | None = None
    """Fraction of tokens clipped above (ppo_clip: ratio > 1 + epsilon_high and A > 0; cispo: weight truncated)."""
    seqs: Tensor | None = None
    """This rank's sequences with at least one counted token (the unit of the per-sequence divisors)."""
    entropy: Tensor | None = None
    """Token mean of the policy's entropy on the completion tokens, those a rollout correction rejects included (NaN
    when the policy view cannot measure it)."""


@dataclass(frozen=True)
class CorrectedChunkStats(ChunkStats):
    """``ChunkStats`` plus the rollout correction's figures (``rl.rollout_correction``), means over the chunk's
    sampled completion tokens (rejected ones included), weighted by them in the roll-up."""

    REDUCE: ClassVar[dict[str, Reduction]] = {
        **ChunkStats.REDUCE,
        "sampled": ("correction/tokens", "sum"),
        # over every completion token: a rejection changes no entropy
        "entropy": ("grpo/entropy", "sampled"),
        "is_weight": ("correction/is_weight_mean", "sampled"),
        "is_weight_sq": ("correction/is_weight_sq_mean", "sampled"),
        "is_weight_max": ("correction/is_weight_max", "max"),
        "outside": ("correction/outside_frac", "sampled"),
        "logprob_gap": ("correction/logprob_gap_mean", "sampled"),
        "mult_prob_error": ("correction/token_mult_prob_error", "sampled"),
        "trainer_logprob": ("correction/trainer_logprob_mean", "sampled"),
        "rollout_logprob": ("correction/rollout_logprob_mean", "sampled"),
    }

    sampled: Tensor | None = None
    """This rank's completion tokens before any rejection."""
    is_weight: Tensor | None = None
    """Mean weight on the surrogate (tis: min(rho, threshold); icepop: rho inside the band, else 0; mask: 1 or 0)."""
    is_weight_sq: Tensor | None = None
    """Mean squared weight (the effective sample size is mean^2 / this)."""
    is_weight_max: Tensor | None = None
    outside: Tensor | None = None
    """Fraction of tokens whose rho left the band (mask: rejected; icepop: zeroed) or passed the threshold (tis)."""
    logprob_gap: Tensor | None = None
    """Mean |log pi_old - log pi_rollout|."""
    mult_prob_error: Tensor | None = None
    """Mean exp|log pi_old - log pi_rollout| (NeMo-RL's token_mult_prob_error)."""
    trainer_logprob: Tensor | None = None
    rollout_logprob: Tensor | None = None

    @classmethod
    def of(cls, base: ChunkStats, sums: dict[str, Tensor]) -> CorrectedChunkStats:
        sampled = sums.pop("sampled")
        means = {
            k: v if k == "is_weight_max" else v / sampled.clamp(min=1)
            for k, v in sums.items()
        }
        return cls(**vars(base), sampled=sampled, **means)
