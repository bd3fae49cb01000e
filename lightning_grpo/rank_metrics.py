"""Across data-parallel ranks: one figure per metric for the whole job, every rank the same dict.

Each rank rolls up its own share (``metrics.roll_up``); ``combine_ranks`` combines them, each name as its
``RANK_*`` set says (docs/distributed.md). Unlisted names (reward/<name>, rates, shares) are means over ranks, exact
because every rank holds the same number of trajectories and groups. grpo/loss is one of them: rank r reports
S_r / N_bar (its loss sum over the DP-mean divisor N_bar), so the mean over ranks is sum(S_r) / sum(N_r), the whole
batch's token mean.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch

from lightning_grpo.timing import PHASES, PREFIX

RANK_SUM = frozenset(
    {
        "grpo/tokens",
        "correction/tokens",
        "grpo/n",
        "grpo/seqs",
        "grpo/chunks",
        "grpo/empty_chunks",
        "grpo/oversized_rows",
        "dpo/pairs",
        "data/dynamic_groups_dropped",
        "data/dynamic_prompts_drawn",
        "data/dynamic_batch_short",
        "completion/truncated_masked",
    }
)
"""Counts of this rank's share: summed, they count the whole collected batch."""
RANK_TOKEN_WEIGHTED = frozenset(
    {
        "grpo/clip_frac",
        "grpo/clip_frac_low",
        "grpo/clip_frac_high",
        "grpo/ratio_mean",
        "grpo/kl",
        "grpo/kl_old",
        "grpo/entropy",
        "opd/kl",
        "opd/teacher_logprob",
    }
)
"""Per-token figures of this rank's tokens: weighted by ``grpo/tokens`` (ranks hold unequal token counts)."""
RANK_SAMPLED_WEIGHTED = frozenset(
    {
        f"correction/{name}"
        for name in (
            "is_weight_mean",
            "is_weight_sq_mean",
            "outside_frac",
            "logprob_gap_mean",
            "token_mult_prob_error",
            "trainer_logprob_mean",
            "rollout_logprob_mean",
        )
    }
)
"""Rollout-correction means over this rank's sampled tokens (rejected ones too): weighted by ``correction/tokens``."""
RANK_MAX = frozenset(
    {
        "grpo/ratio_max",
        "correction/is_weight_max",
        "reward/max",
        "completion/len_max",
        "rollout/staleness_worst",
        "rollout/version_span",
        "mismatch/kl_max",
        "mismatch/logprob_diff_max",
        "mismatch/seconds",
        *(PREFIX + phase for phase in PHASES),
    }
)
RANK_MIN = frozenset({"reward/min", "completion/len_min"})
RANK_WEIGHTED = {"completion/terminated_len_mean": "completion/stop_frac"}
"""Means over a subset of each rank's rows, weighted by the subset's share (ranks hold equal row counts)."""
RANK_SAME = frozenset(
    {"step", "loop_step", "global_step", "data/dynamic_refill_rounds"}
    | {
        f"{prefix}/{name}"
        for prefix in ("grpo", "dpo")
        for name in (
            "denom",
            "grad_norm",
            "grad_norm_max",
            "lr",
            "lr_max",
            "optimizer_steps",
            "skipped_windows",
            "consecutive_skips",
            "discarded_chunks",
        )
    }
)
"""Equal on every rank by construction (the divisor is already a DP mean, the norm is taken after the gradient
sync, skip decisions are collective); reduced with max, so a disagreement could only show the worse value."""
RANK_POOLED_STD = frozenset({"reward/std"})
"""Unbiased std of all rewards, pooled exactly from each rank's ``reward/mean`` and ``reward/std``."""

AllReduce = Callable[[torch.Tensor, str], torch.Tensor]
"""``(tensor, op)`` -> the tensor reduced over data-parallel ranks, op ``"sum"`` or ``"max"``."""


def rank_reduction(name: str) -> str:
    """How metric ``name`` combines over ranks: sum, token, sampled, weighted, max, min, same, std or mean."""
    if name in RANK_WEIGHTED:
        return "weighted"
    # per inner epoch: each epoch trains the same rows, so the rank's tokens weigh
    if name.startswith("grpo/epoch"):
        return "token"
    for kind, names in (
        ("sum", RANK_SUM),
        ("token", RANK_TOKEN_WEIGHTED),
        ("sampled", RANK_SAMPLED_WEIGHTED),
        ("max", RANK_MAX),
        ("min", RANK_MIN),
        ("same", RANK_SAME),
        ("std", RANK_POOLED_STD),
    ):
        if name in names:
            return kind
    return "mean"


_WEIGHT_OF = {"token": "grpo/tokens", "sampled": "correction/tokens"}
"""The count each weighted mean is over (by its ``rank_reduction`` kind)."""


def combine_ranks(
    metrics: dict[str, float], all_reduce: AllReduce, world_size: int, rows: int
) -> dict[str, float]:
    """One figure per metric for the whole job from this rank's figures; every rank returns the same dict.

    Three small all-reduces per loop step (a check that every rank has the same names, then one float64
    vector summed and one maxed) instead of one collective per metric.

    Args:
        metrics: this rank's figures (``roll_up`` + rollout metrics + counters).
        all_reduce: reduces a tensor over the data-parallel ranks (``trainer.strategy.reduce``).
        world_size: data-parallel ranks.
        rows: trajectories per rank (the same on every rank); pools ``reward/std``.
    """
    names = sorted(metrics)
    _check_same_names(names, all_reduce)
    kind = {n: rank_reduction(n) for n in names}
    # over every completion token, rejected ones too
    if "correction/tokens" in kind and "grpo/entropy" in kind:
        kind["grpo/entropy"] = "sampled"
    summed = [
        n
        for n in names
        if kind[n] in ("sum", "token", "sampled", "weighted", "std", "mean")
    ]
    maxed = [n for n in names if kind[n] in ("max", "min", "same")]
    local = _rank_terms(metrics, kind, rows)
    out = dict(zip(summed, _reduced(all_reduce, [local[n] for n in summed], "sum")))
    out.update(zip(maxed, _reduced(all_reduce, [local[n] for n in maxed], "max")))
    _finish_reduced(out, kind, world_size, rows)
    return out


def _check_same_names(names: list[str], all_reduce: AllReduce) -> None:
    """Raise unless every rank logged the same metric names (one all-reduce of a checksum and its negative)."""
    key = float(zlib.crc32("\n".join(names).encode()))
    check = all_reduce(torch.tensor([key, -key], dtype=torch.float64), "max")
    # max == min: every rank logged the same names
    if float(check[0]) != -float(check[1]):
        raise RuntimeError(
            f"combine_ranks: data-parallel ranks logged different metric names; this rank: {names}"
        )


def _rank_terms(
    metrics: dict[str, float], kind: dict[str, str], rows: int
) -> dict[str, float]:
    """This rank's term of each metric, in the form that sums (or maxes) over ranks."""
    local = {n: metrics[n] for n in kind}
    for n in kind:
        if kind[n] in _WEIGHT_OF:
            # this rank's sum over its tokens
            local[n] = metrics[n] * metrics.get(_WEIGHT_OF[kind[n]], 0.0)
        elif kind[n] == "std":  # this rank's sum of squared rewards
            local[n] = (rows - 1) * metrics[n] ** 2 + rows * metrics.get(
                "reward/mean", 0.0
            ) ** 2
        elif kind[n] == "min":
            local[n] = -metrics[n]
        # a rank with none of the subset (NaN mean) adds nothing
        elif kind[n] == "weighted":
            share = metrics.get(RANK_WEIGHTED[n], 0.0)
            local[n] = metrics[n] * share if share > 0 else 0.0
    return local


def _finish_reduced(
    out: dict[str, float], kind: dict[str, str], world_size: int, rows: int
) -> None:
    """The reduced sums and maxima, in place, into the job's figures: means divided, minima negated back."""
    # summed, before the means
    shares = {n: out.get(RANK_WEIGHTED[n], 0.0) for n in kind if kind[n] == "weighted"}
    for n in kind:
        if kind[n] == "mean":
            out[n] /= world_size
        elif kind[n] in _WEIGHT_OF:
            all_tokens = out.get(_WEIGHT_OF[kind[n]], 0.0)
            out[n] = (
                out[n] / all_tokens
                if all_tokens > 0
                else (math.nan if math.isnan(out[n]) else 0.0)
            )
        elif kind[n] == "min":
            out[n] = -out[n]
        elif kind[n] == "weighted":
            out[n] = out[n] / shares[n] if shares[n] > 0 else math.nan
    # after the means: the pooled std reads the job's reward/mean
    for n in (n for n in kind if kind[n] == "std"):
        count = rows * world_size
        mean = out.get("reward/mean", 0.0)
        out[n] = (
            math.sqrt(max(out[n] - count * mean * mean, 0.0) / (count - 1))
            if count > 1
            else 0.0
        )


def _reduced(all_reduce: AllReduce, values: list[float], op: str) -> list[float]:
    return (
        all_reduce(torch.tensor(values, dtype=torch.float64), op).tolist()
        if values
        else []
    )
