"""The GRPO objective family: a clipped (PPO) or CISPO surrogate against pi_old, per token or per sequence, an
optional k3 KL, and one of four divisors (``rl.loss_type``).

Tensors in, ``(loss, denom, stats)`` out. ``loss`` is the chunk's sum over the divisor ``denom`` (a DP mean: the
step's completion tokens by default), so the accumulator recovers the chunk sum as ``loss * denom`` and defers the
division to the optimizer step. Every divisor below is a sum over rows and a chunk is a set of whole rows
(``ChunkPlan``), so a per-sequence mean or a per-sequence ratio is exact under any chunking.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor, nn

from lightning_grpo.batch import RolloutBatch
from lightning_grpo.correction import Correction, RolloutCorrection, correct
from lightning_grpo.distributed import single_process
from lightning_grpo.objectives.base import PolicyView
from lightning_grpo.objectives.chunk_stats import ChunkStats, CorrectedChunkStats
from lightning_grpo.objectives.entropy import token_mean, top_entropy_mask

# Reduces a scalar tensor to its mean over data-parallel ranks (identity on one device).
DPMean = Callable[[Tensor], Tensor]


class GRPOObjective:
    """Clipped surrogate (PPO-style) or CISPO, per-token or per-sequence ratio, optional k3 KL, four divisors.

    Args:
        epsilon: lower clip range (ratio >= 1 - epsilon).
        epsilon_high: upper clip range (ratio <= 1 + epsilon_high).
        beta: KL weight; 0 skips the KL term (no reference logprobs needed).
        dp_mean: all-reduce mean over data-parallel ranks for the divisor.
        loss_type: the divisor (``rl.loss_type``): dapo, grpo, dr_grpo or seq-mean-token-sum.
        ratio_level: token (PPO/GRPO) or sequence (GSPO: the length-normalized sequence ratio).
        loss: ppo_clip (``-min(r A, clip(r) A)``) or cispo (``-sg(clip(r)) A log pi``).
        max_completion_length: Dr. GRPO's constant (``rollout.max_new_tokens``); needed by dr_grpo only.
        correction: ``rl.rollout_correction`` (None or mode off: none); needs the chunk's sampler logprobs.
        entropy_coef: entropy bonus: ``coef * H`` is subtracted from every counted token's loss (same divisor).
        top_entropy_quantile: train the surrogate only on each sequence's top share of tokens by entropy (1.0 = all).
    """

    name = "grpo"
    # names every grpo/* figure of a loop step where no chunk stepped
    stats = ChunkStats

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        dp_mean: DPMean = single_process,
        *,
        loss_type: str = "dapo",
        ratio_level: str = "token",
        loss: str = "ppo_clip",
        max_completion_length: int | None = None,
        correction: RolloutCorrection | None = None,
        entropy_coef: float = 0.0,
        top_entropy_quantile: float = 1.0,
    ) -> None:
        # The knobs' rules are GRPOConfig's (refused at load); this one is about the arguments a caller passes.
        if loss_type == "dr_grpo" and not max_completion_length:
            raise ValueError(
                "GRPOObjective(loss_type='dr_grpo') needs max_completion_length (rollout.max_new_tokens)"
            )
        self.epsilon = epsilon
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high
        self.beta = beta
        self.dp_mean = dp_mean
        self.loss_type = loss_type
        self.ratio_level = ratio_level
        self.loss = loss
        self.max_completion_length = max_completion_length
        self.correction = (
            correction if correction is not None and correction.mode != "off" else None
        )
        if self.correction is not None:
            self.stats = CorrectedChunkStats
        self.entropy_coef = entropy_coef
        self.top_entropy_quantile = top_entropy_quantile

    def needs_old_logprobs(self) -> bool:
        """The ratio consumes pi_old, so mini-batching needs it frozen (the ahead pass)."""
        return True

    def needs_reference(self) -> bool:
        """The k3 KL needs the frozen initial policy; beta == 0 builds none."""
        return self.beta > 0

    def setup(self, policy: nn.Module, tokenizer) -> None:
        """Nothing to build."""

    def chunk_loss(
        self, chunk: RolloutBatch, policy: PolicyView, old_logprobs: Tensor | None
    ) -> tuple[Tensor, Tensor, ChunkStats]:
        """Score ``chunk`` with the policy (and the reference when beta > 0), then the loss below."""
        uses_entropy = self.entropy_coef > 0 or self.top_entropy_quantile < 1
        # the entropy comes from the same head pass (logprobs.py)
        if policy.logprobs_and_entropy is not None:
            logprobs, entropy = policy.logprobs_and_entropy(
                chunk, self.entropy_coef > 0
            )
        elif uses_entropy:
            raise ValueError(
                "GRPOObjective(entropy_coef > 0 or top_entropy_quantile < 1) needs a PolicyView with "
                "logprobs_and_entropy"
            )
        else:
            logprobs = policy.logprobs(chunk)
            entropy = None
        ref = (
            policy.reference(chunk)
            if self.beta > 0 and policy.reference is not None
            else None
        )
        rollout = (
            chunk.rollout_logprobs[:, 1:]
            if chunk.rollout_logprobs is not None
            else None
        )
        return self(
            logprobs,
            chunk.completion_mask[:, 1:],
            chunk.advantages,
            old_logprobs,
            ref,
            rollout,
            entropy=entropy,
        )

    def __call__(
        self,
        logprobs: Tensor,
        mask: Tensor,
        advantages: Tensor,
        old_logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        rollout_logprobs: Tensor | None = None,
        *,
        entropy: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, ChunkStats]:
        """Loss of one chunk.

        Args:
            logprobs: ``[B, T-1]`` current per-token logprobs (with grad).
            mask: ``[B, T-1]`` bool, True on tokens that count.
            advantages: ``[B]``.
            old_logprobs: ``[B, T-1]`` pi_old; None = ``logprobs.detach()`` (exact when nothing moved).
            ref_logprobs: ``[B, T-1]`` reference policy, required when beta > 0.
            rollout_logprobs: ``[B, T-1]`` the sampler's logprobs, required by a rollout correction.
            entropy: ``[B, T-1]`` the policy's entropy (logged; with grad when entropy_coef > 0), required when
                entropy_coef > 0 or top_entropy_quantile < 1.
        """
        old = logprobs.detach() if old_logprobs is None else old_logprobs
        corr = self._correction(logprobs, old, rollout_logprobs, mask)
        # every completion token, rejected ones too (grpo/entropy's)
        completion = mask.to(logprobs.dtype)
        if corr is not None and corr.keep is not None:
            mask = corr.keep  # rejected tokens leave the loss and its divisor
        m = mask.to(logprobs.dtype)
        ratio = self._ratio(logprobs, old, m)  # [B, T-1]
        adv = advantages.to(logprobs.dtype).unsqueeze(-1)  # [B, 1]
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
        per_token = self._surrogate(logprobs, ratio, clipped, adv, mask, corr, entropy)
        kl = self._kl(per_token, logprobs, ref_logprobs)
        per_token = self._regularized(per_token, kl, entropy)
        tokens = m.sum()
        # rows with a counted token: a DP filler row is no sequence
        seqs = (m.sum(-1) > 0).to(m.dtype).sum()
        loss, denom = self._loss_and_divisor(per_token, m, tokens, seqs)
        with torch.no_grad():
            stats = self._stats(
                loss,
                denom,
                tokens,
                seqs,
                ratio,
                clipped,
                adv,
                kl,
                logprobs - old,
                m,
                mask,
            )
            stats = self._with_entropy_and_correction(stats, entropy, completion, corr)
        return loss, denom, stats

    def _kl(
        self, per_token: Tensor, logprobs: Tensor, ref_logprobs: Tensor | None
    ) -> Tensor:
        """``[B, T-1]`` k3 KL to the reference (zeros when beta == 0)."""
        if not self.beta > 0:
            return torch.zeros_like(per_token)
        if ref_logprobs is None:
            raise ValueError(
                "GRPOObjective(beta>0) needs ref_logprobs; build the module with a reference model"
            )
        delta = ref_logprobs - logprobs
        return torch.exp(delta) - delta - 1  # k3 estimator: unbiased, always >= 0

    def _regularized(
        self, per_token: Tensor, kl: Tensor, entropy: Tensor | None
    ) -> Tensor:
        """``[B, T-1]`` the surrogate plus ``beta`` x the KL, minus the entropy bonus."""
        if self.beta > 0:
            per_token = per_token + self.beta * kl
        # a bonus: lower loss for a higher-entropy policy, under the loss's own divisor
        if self.entropy_coef > 0:
            per_token = per_token - self.entropy_coef * entropy
        return per_token

    def _loss_and_divisor(
        self, per_token: Tensor, m: Tensor, tokens: Tensor, seqs: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The chunk's loss (its sum over the divisor) and the divisor."""
        total, denom = self._sum_and_divisor(per_token, m, tokens, seqs)
        # Guard zero only: an all-masked chunk has denom 0 and loss 0, never 0/0. Under DP the divisor is a mean and
        # may be in (0, 1) (fewer tokens than ranks); clamping it to 1 would make loss * denom differ from the chunk sum.
        loss = total / torch.where(denom > 0, denom, torch.ones_like(denom))
        return loss, denom

    @staticmethod
    def _with_entropy_and_correction(
        stats: ChunkStats,
        entropy: Tensor | None,
        completion: Tensor,
        corr: Correction | None,
    ) -> ChunkStats:
        """``stats`` plus the entropy over every completion token and the correction's figures (if any)."""
        stats = replace(
            stats, entropy=token_mean(entropy, completion, completion.sum())
        )
        if corr is not None:
            stats = CorrectedChunkStats.of(stats, dict(corr.stats))
        return stats

    def _surrogate(
        self,
        logprobs: Tensor,
        ratio: Tensor,
        clipped: Tensor,
        adv: Tensor,
        mask: Tensor,
        corr: Correction | None,
        entropy: Tensor | None,
    ) -> Tensor:
        """``[B, T-1]`` per-token surrogate: clipped or CISPO, times the correction's weight, on the kept tokens."""
        if self.loss == "cispo":
            # CISPO (MiniMax-M1, arXiv 2506.13585): the truncated ratio, no gradient, weighs each token's REINFORCE term
            per_token = -(clipped.detach() * adv) * logprobs
        else:
            per_token = -torch.min(ratio * adv, clipped * adv)
        if corr is not None and corr.weight is not None:
            # the surrogate only: the KL to the reference is not sampled
            per_token = per_token * corr.weight
        if (self.entropy_coef > 0 or self.top_entropy_quantile < 1) and entropy is None:
            raise ValueError(
                "GRPOObjective(entropy_coef > 0 or top_entropy_quantile < 1) needs the policy's entropy"
            )
        # the surrogate on high-entropy tokens only; the KL and divisor stay whole
        if self.top_entropy_quantile < 1:
            per_token = per_token * top_entropy_mask(
                entropy, mask, self.top_entropy_quantile
            )
        return per_token

    def _correction(
        self, logprobs: Tensor, old: Tensor, rollout: Tensor | None, mask: Tensor
    ) -> Correction | None:
        """rho = pi_old / pi_rollout per token (bypass: pi_old is the sampler's, so the current policy stands in)."""
        if self.correction is None:
            return None
        if rollout is None:
            raise ValueError(
                f"rl.rollout_correction.mode={self.correction.mode!r} needs the sampler's logprobs, and "
                "this chunk has none (Rollout.logprobs; a replay file's 'logprobs' field)"
            )
        trainer = logprobs.detach() if self.correction.mode == "bypass" else old
        return correct(self.correction, trainer, rollout.to(trainer.dtype), mask)

    def _ratio(self, logprobs: Tensor, old: Tensor, m: Tensor) -> Tensor:
        """``[B, T-1]`` ratio: per token, or GSPO's ``exp(mean_t(logp - old))`` repeated over its sequence."""
        if self.ratio_level == "token":
            return torch.exp(logprobs - old)  # [B, T-1]
        lengths = m.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
        # GSPO (arXiv 2507.18071): s_i = exp(mean over the sequence's tokens of (logp - old)), length-normalized
        log_ratio = ((logprobs - old) * m).sum(-1, keepdim=True) / lengths  # [B, 1]
        # [B, T-1]; the gradient reaches every token of the sequence
        return torch.exp(log_ratio).expand_as(m)

    def _sum_and_divisor(
        self, per_token: Tensor, m: Tensor, tokens: Tensor, seqs: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The chunk's sum under ``loss_type`` and its DP-mean divisor (one ``dp_mean`` call)."""
        if self.loss_type == "dapo":  # today's expression, kept as is (bit-identical)
            return (per_token * m).sum(), self.dp_mean(tokens.detach())
        row_sum = (per_token * m).sum(-1)  # [B]
        # each sequence's token mean, then the mean over sequences
        if self.loss_type == "grpo":
            return (row_sum / m.sum(-1).clamp(min=1)).sum(), self.dp_mean(seqs.detach())
        # token sum over a constant: max_new_tokens x sequences
        if self.loss_type == "dr_grpo":
            return row_sum.sum(), self.dp_mean(
                seqs.detach() * self.max_completion_length
            )
        # seq-mean-token-sum: each sequence's sum, mean over them
        return row_sum.sum(), self.dp_mean(seqs.detach())

    def _stats(
        self, loss, denom, tokens, seqs, ratio, clipped, adv, kl, log_ratio, m, mask
    ) -> ChunkStats:
        """The chunk's figures; per-token ones over this rank's tokens (``tokens`` weighs them in the roll-up)."""
        local = tokens.clamp(min=1)
        # [B, T-1]
        token_ratio = ratio if self.ratio_level == "token" else torch.exp(log_ratio)
        # the weight is truncated whatever the advantage's sign
        if self.loss == "cispo":
            low = (ratio < 1 - self.epsilon).to(m.dtype) * m
            high = (ratio > 1 + self.epsilon_high).to(m.dtype) * m
            is_clipped = low + high
        else:
            # the min picked the clipped term
            is_clipped = ((ratio * adv) > (clipped * adv)).to(m.dtype) * m
            low = ((ratio < 1 - self.epsilon) & (adv < 0)).to(m.dtype) * m
            high = ((ratio > 1 + self.epsilon_high) & (adv > 0)).to(m.dtype) * m
        return ChunkStats(
            loss=loss.detach(),
            denom=denom,
            tokens=tokens,
            # 16-true sets a half default dtype
            n=torch.tensor(float(mask.shape[0]), dtype=torch.float32),
            clip_frac=is_clipped.sum() / local,
            ratio_mean=(ratio * m).sum() / local,
            ratio_max=ratio.detach().masked_fill(~mask, float("-inf")).amax()
            if mask.numel()
            else tokens * 0,
            kl=(kl * m).sum() / local,
            # k3, r = pi / pi_old per token
            kl_old=((token_ratio - 1 - log_ratio) * m).sum() / local,
            clip_frac_low=low.sum() / local,
            clip_frac_high=high.sum() / local,
            seqs=seqs,
        )
