"""Rollout correction: the sampler (vLLM in bf16, an older policy, another kernel) is not the trainer.

The trajectories were drawn from pi_rollout, but the loss treats them as drawn from pi_old (the trainer's own
logprobs). ``rl.rollout_correction`` corrects that per token with rho = pi_old / pi_rollout, from the sampler
logprobs both engines return (the "decoupled" form, three policies), or drops pi_old altogether:

* ``tis``: truncated importance sampling, the surrogate times ``min(rho, threshold)`` (Yao et al. 2025, "Your
  efficient RL framework secretly brings you off-policy RL training"; verl ``rollout_is``; TRL ``*_truncate``).
* ``mask``: rejection, the tokens (or whole sequences) whose rho leaves ``band`` are taken out of the loss and
  its divisor (verl ``rollout_rs`` ``token_k1``, ``seq_sum_k1``, ``seq_mean_k1``: their bounds are on -log rho, so
  verl's ``L_U`` is ``band: [1/U, 1/L]`` here). TRL's ``*_mask`` keep the divisor: they are ``icepop``.
* ``icepop``: IcePop (Ling team 2025, "Every Step Evolves"): the surrogate times rho inside ``band`` and 0
  outside, per token; the divisor keeps every token, as in the paper. TRL's ``token_mask`` (band ``[0, cap]``); at
  ``level: sequence`` the sequence's product rho weighs or zeroes all its tokens, TRL's ``sequence_mask``.
* ``bypass``: pi_old *is* pi_rollout (no trainer pi_old, no ahead pass); the PPO ratio pi / pi_rollout does the
  correction (verl ``bypass_mode``, slime ``--use-rollout-logprobs``).

Levels: ``token`` rho_t; ``sequence`` prod_t rho_t (one weight per row); ``geometric`` exp(mean_t log rho_t).
Every level is a function of one row, and a chunk is a set of whole rows, so the correction is exact under any
chunking. The weights carry no gradient. ``log rho`` is bounded to [-20, 20] first (as verl): a product over a
long sequence must not overflow to inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lightning_grpo.checks import is_finite, raise_problems

MODES = ("off", "tis", "mask", "icepop", "bypass")
LEVELS = ("token", "sequence", "geometric")
DEFAULT_BAND = {"mask": (0.5, 2.0), "icepop": (0.5, 5.0)}
"""``band`` when unset: verl's reciprocal pair around its threshold 2.0, and IcePop's published [0.5, 5.0]."""
DEFAULT_THRESHOLD = 2.0
"""``threshold`` when unset (tis): verl's ``rollout_is_threshold`` default."""
LOG_BOUND = 20.0


@dataclass
class RolloutCorrection:
    """``rl.rollout_correction``: how the loss corrects for pi_rollout != pi_old (docs/objectives.md)."""

    mode: Literal["off", "tis", "mask", "icepop", "bypass"] = "off"
    """off | tis (truncated IS weight) | mask (reject outside ``band``, verl's rollout_rs) | icepop (IS weight inside
    ``band``, 0 outside: TRL's token_mask / sequence_mask) | bypass (pi_old = the sampler's logprobs, no ahead pass)."""
    level: Literal["token", "sequence", "geometric"] = "token"
    """rho per token, per sequence (the product), or geometric (exp of the token mean of log rho; mask only)."""
    threshold: float | None = None
    """tis: the weight is min(rho, threshold); None = 2.0. Only tis reads it (set with another mode: refused)."""
    band: tuple[float, float] | None = None
    """mask / icepop: rho must lie in [low, high]; None = (0.5, 2.0) for mask, (0.5, 5.0) for icepop."""

    def __post_init__(self) -> None:
        if isinstance(self.band, list):  # YAML gives a list
            self.band = tuple(self.band)
        raise_problems("rl.rollout_correction", self.problems())

    @property
    def active(self) -> bool:
        """Reweights or rejects with rho (needs the sampler's logprobs and a trainer pi_old)."""
        return self.mode in ("tis", "mask", "icepop")

    @property
    def needs_sampler_logprobs(self) -> bool:
        """The engine must return its per-token logprobs (every mode but off)."""
        return self.mode != "off"

    @property
    def cap(self) -> float:
        """The TIS truncation in force: ``threshold``, else 2.0 (verl's ``rollout_is_threshold``)."""
        return DEFAULT_THRESHOLD if self.threshold is None else self.threshold

    @property
    def bounds(self) -> tuple[float, float]:
        """The band in force: ``band``, else the mode's default (no bound for the modes without one)."""
        return (
            self.band
            if self.band is not None
            else DEFAULT_BAND.get(self.mode, (0.0, math.inf))
        )

    def problems(self) -> list[str]:
        """Every broken rule as a ``field=value: rule; fix`` line."""
        p = []
        if self.mode not in MODES:
            return [f"mode={self.mode!r}: must be one of {', '.join(map(repr, MODES))}"]
        if self.level not in LEVELS:
            p.append(
                f"level={self.level!r}: must be one of {', '.join(map(repr, LEVELS))}"
            )
        elif self.level == "geometric" and self.mode in ("tis", "icepop"):
            p.append(
                f"level='geometric' with mode={self.mode!r}: the geometric mean is a rejection band for "
                "mode='mask' (verl rollout_rs=geometric); use level='token' or 'sequence'"
            )
        elif self.level != "token" and self.mode in ("off", "bypass"):
            p.append(
                f"level={self.level!r} with mode={self.mode!r}: no weight is computed; leave level='token'"
            )
        if self.threshold is not None and (
            not is_finite(self.threshold) or self.threshold <= 1
        ):
            p.append(
                f"threshold={self.threshold}: must be a finite number > 1 (TIS truncates rho at it; 2.0 is usual)"
            )
        # it would be ignored without a word
        elif self.threshold is not None and self.mode != "tis":
            p.append(
                f"threshold={self.threshold} with mode={self.mode!r}: only tis truncates at a threshold; "
                + (
                    "set band=[low, high] instead"
                    if self.mode in DEFAULT_BAND
                    else "drop threshold"
                )
            )
        if self.band is not None:
            low, high = (
                (tuple(self.band) + (None, None))[:2]
                if len(self.band) == 2
                else (None, None)
            )
            if not (is_finite(low) and is_finite(high) and 0 <= low < 1 < high):
                p.append(
                    f"band={self.band!r}: must be [low, high] with 0 <= low < 1 < high (e.g. [0.5, 2.0])"
                )
            elif self.mode not in ("mask", "icepop"):
                p.append(
                    f"band={self.band!r} with mode={self.mode!r}: only mask and icepop use a band"
                )
        return p


@dataclass(frozen=True)
class Correction:
    """One chunk's correction: ``weight`` multiplies the surrogate, ``keep`` masks the loss and its divisor."""

    weight: Tensor | None
    """``[B, T-1]`` detached weight (None: 1 everywhere)."""
    keep: Tensor | None
    """``[B, T-1]`` bool: False on rejected tokens (None: nothing rejected)."""
    stats: dict[str, Tensor]
    """Sums over this chunk's completion tokens (``CorrectedChunkStats`` turns them into means)."""


def correct(
    cfg: RolloutCorrection, trainer: Tensor, rollout: Tensor, mask: Tensor
) -> Correction:
    """The correction of one chunk from the trainer's pi_old and the sampler's logprobs (``[B, T-1]`` each)."""
    m = mask.to(trainer.dtype)
    log_rho = ((trainer - rollout) * m).clamp(-LOG_BOUND, LOG_BOUND)  # [B, T-1]
    if cfg.level == "token":
        rho = torch.exp(log_rho)
    else:
        row = log_rho.sum(-1, keepdim=True)  # [B, 1]
        if cfg.level == "geometric":
            row = row / m.sum(-1, keepdim=True).clamp(min=1)
        rho = torch.exp(row.clamp(-LOG_BOUND, LOG_BOUND)).expand_as(log_rho)
    low, high = cfg.bounds
    inside = (rho >= low) & (rho <= high)
    weight = keep = None
    if cfg.mode == "tis":
        weight = rho.clamp(max=cfg.cap)
    elif cfg.mode == "mask":
        keep = inside & mask
    elif cfg.mode == "icepop":
        weight = torch.where(inside, rho, torch.zeros_like(rho))
    w = (
        weight
        if weight is not None
        else keep.to(m.dtype)
        if keep is not None
        else torch.ones_like(m)
    ) * m
    gap = (trainer - rollout) * m
    stats = {
        "is_weight": w.sum(),
        "is_weight_sq": (w * w).sum(),
        "is_weight_max": w.detach().masked_fill(~mask, float("-inf")).amax()
        if mask.numel()
        else m.sum() * 0,
        "outside": (
            ((rho > cfg.cap) if cfg.mode == "tis" else ~inside).to(m.dtype) * m
        ).sum(),
        "logprob_gap": gap.abs().sum(),
        "mult_prob_error": (torch.exp(gap.abs()) * m).sum(),
        "trainer_logprob": (trainer * m).sum(),
        "rollout_logprob": (rollout * m).sum(),
        "sampled": m.sum(),
    }
    return Correction(weight, keep, stats)


def derived_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Figures that are ratios of the job-wide means: effective sample size and the two perplexities."""
    if "correction/is_weight_mean" not in metrics:
        return {}
    mean = metrics["correction/is_weight_mean"]
    sq = metrics["correction/is_weight_sq_mean"]
    return {
        "correction/ess": mean * mean / sq if sq > 0 else math.nan,
        "correction/training_ppl": math.exp(
            -metrics["correction/trainer_logprob_mean"]
        ),
        "correction/rollout_ppl": math.exp(-metrics["correction/rollout_logprob_mean"]),
    }
