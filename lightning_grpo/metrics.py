"""Roll-up: one set of metrics per collected batch, each with the reduction its meaning needs.

* Each objective's stats class lists its reductions (``REDUCE``); GRPO's are below.
* ``grpo/loss`` is token-weighted: ``sum(loss_i * denom_i) / sum(denom_i)``. Each chunk's loss
  is already a mean over its own tokens, so a plain mean of chunk losses is a mean of means
  (wrong on unequal lengths); weighting by the divisor telescopes back to the batch loss.
* Counts (``grpo/n``, ``grpo/tokens``, ``grpo/denom``) are summed.
* Per-token ratios (clip fraction, ratio mean, KL) are weighted by this rank's tokens.
* Per-optimizer-step figures (grad norm, lr) are mean and max over the steps of the batch.
* Every name is logged on every loop step: a loop step whose windows were all skipped logs NaN for
  the figures of trained chunks and taken steps and 0 for the counts, never nothing (Lightning
  would re-log the previous step's cached value for a missing key, and a resumed run a blank).
* Across data-parallel ranks ``combine_ranks`` makes one figure per metric for the whole job
  (``rank_metrics.py``: the ``RANK_*`` sets; docs/distributed.md).
"""

from __future__ import annotations

import math

import torch

from lightning_grpo.correction import derived_metrics
from lightning_grpo.rank_metrics import AllReduce, combine_ranks
from lightning_grpo.timing import AHEAD, PREFIX, UPDATE
from lightning_grpo.update.loop import LoopResult


def roll_up(
    result: LoopResult, prefix: str = "grpo", stats: type | None = None
) -> dict[str, float]:
    """Metrics of one collected batch from the chunks that stepped and each window's outcome (always every name).

    Each chunk's figures roll up as its stats class says (``REDUCE``: field -> metric name and ``sum``, ``max``
    or the field that weighs a mean), so any objective's stats work here unchanged. ``prefix`` names the
    per-optimizer-step figures (``grpo/grad_norm``, ``dpo/grad_norm``, ...). On a loop step where no chunk
    stepped, ``stats`` (the objective's stats class) still names every figure: counts 0, the rest NaN, so a
    logger never shows a stale cached value.
    """
    stats = type(result.chunks[0]) if result.chunks else stats
    table_names = getattr(stats, "REDUCE", {}).values()
    out: dict[str, float] = {
        metric: 0.0 if how == "sum" else math.nan for metric, how in table_names
    }
    out |= {
        f"{prefix}/{name}": math.nan
        for name in ("grad_norm", "grad_norm_max", "lr", "lr_max")
    }
    if result.chunks:
        reduce = type(result.chunks[0]).REDUCE
        names = tuple(reduce)
        # [K, F] on the host in one transfer (one CPU-GPU sync per collected batch).
        table = torch.stack(
            [torch.stack([_stat(c, f) for f in names]) for c in result.chunks]
        )
        col = dict(zip(names, table.unbind(-1)))
        for name, (metric, how) in reduce.items():
            if how == "sum":
                out[metric] = float(col[name].sum())
            elif how == "max":
                out[metric] = float(col[name].max())
            # a mean weighted by another field: telescopes to the unchunked batch's figure
            else:
                out[metric] = _ratio((col[name] * col[how]).sum(), col[how].sum())
        out.update(_per_epoch(result, col))
    stepped = [s for s in result.steps if not s.skipped]
    if stepped:
        norms = [s.grad_norm for s in stepped]
        lrs = [s.lr for s in stepped]
        out[f"{prefix}/grad_norm"] = sum(norms) / len(norms)
        out[f"{prefix}/grad_norm_max"] = max(norms)
        out[f"{prefix}/lr"] = sum(lrs) / len(lrs)
        out[f"{prefix}/lr_max"] = max(lrs)
    out[f"{prefix}/optimizer_steps"] = float(len(stepped))
    out[f"{prefix}/skipped_windows"] = float(len(result.steps) - len(stepped))
    out[f"{prefix}/consecutive_skips"] = float(result.consecutive_skips)
    out[f"{prefix}/discarded_chunks"] = float(result.discarded_chunks)
    return out


def _stat(chunk, name: str) -> torch.Tensor:
    value = getattr(chunk, name)
    return (
        torch.zeros((), dtype=torch.float64) if value is None else value.double().cpu()
    )


def _per_epoch(result: LoopResult, col: dict[str, torch.Tensor]) -> dict[str, float]:
    """At ``mu_iterations > 1``: clip fraction and KL to pi_old of each inner epoch (token-weighted), 1-based."""
    epochs = torch.tensor(result.chunk_epochs, dtype=torch.long)
    if (
        not {"tokens", "clip_frac", "kl_old"} <= col.keys()
        or not len(epochs)
        or int(epochs.max()) == 0
    ):
        return {}
    out = {}
    for e in range(int(epochs.max()) + 1):
        tokens = col["tokens"][epochs == e]
        for name in ("clip_frac", "kl_old"):
            out[f"grpo/epoch{e + 1}/{name}"] = _ratio(
                (col[name][epochs == e] * tokens).sum(), tokens.sum()
            )
    return out


def plan_metrics(plan) -> dict[str, float]:
    """How the last collected batch was cut (this rank, one epoch): real chunks, DP fillers, rows over the budget."""
    if plan is None:
        return {}
    return {
        "grpo/chunks": float(plan.real_chunks),
        "grpo/empty_chunks": float(plan.empty_chunks),
        "grpo/oversized_rows": float(plan.oversized),
    }


def update_metrics(
    result: LoopResult, plan, stats: type | None = None
) -> dict[str, float]:
    """One update's roll-up and how its batch was cut."""
    return {**roll_up(result, stats=stats), **plan_metrics(plan)}


def time_metrics(columns: dict[str, float]) -> dict[str, float]:
    """The step timer's ``time/<phase>`` columns and the ahead pass's share of the update."""
    out = dict(columns)
    update = columns[PREFIX + UPDATE]
    ahead = columns[PREFIX + AHEAD]
    out[PREFIX + "ahead_share"] = ahead / update if update > 0 else 0.0
    return out


def loop_step_row(
    metrics: dict[str, float],
    counters: dict[str, float],
    timer_columns: dict[str, float],
    all_reduce: AllReduce,
    world_size: int,
    rows: int,
) -> dict[str, float]:
    """One loop step's row for the whole job, GRPO's and DPO's alike: ``metrics`` (the roll-up and what the module
    adds), the ``counters`` (``step``, ``loop_step``, ``global_step``) and the step timer's ``time/*`` columns, one
    figure per metric (``job_metrics``; ``rows``: trajectories or pairs per rank)."""
    row = {**metrics, **counters, **time_metrics(timer_columns)}
    return job_metrics(row, all_reduce, world_size, rows)


def job_metrics(
    metrics: dict[str, float], all_reduce: AllReduce, world_size: int, rows: int
) -> dict[str, float]:
    """One figure per metric for the whole job (``combine_ranks`` when several ranks; reductions:
    docs/distributed.md), and the ratios of its means (``correction/ess``, ``*_ppl``)."""
    if world_size > 1:
        metrics = combine_ranks(metrics, all_reduce, world_size, rows)
    return metrics | derived_metrics(metrics)


def length_metrics(
    lengths: torch.Tensor, finish_reasons: list[str]
) -> dict[str, float]:
    """Length figures of this rank's completions (TRL's ``completions/*``): ``lengths`` ``[B]`` completion tokens,
    ``finish_reasons`` ``"stop"`` (EOS or a stop string) or ``"length"`` (cut at ``rollout.max_new_tokens``).

    ``completion/terminated_len_mean`` is NaN when no completion terminated (TRL logs 0, which reads as a length).
    """
    stopped = torch.tensor([r == "stop" for r in finish_reasons], dtype=torch.bool)
    lengths = lengths.double()
    return {
        "completion/len_mean": float(lengths.mean()),
        "completion/len_min": float(lengths.min()),
        "completion/len_max": float(lengths.max()),
        "completion/stop_frac": float(stopped.double().mean()),
        "completion/clipped_frac": float((~stopped).double().mean()),
        "completion/terminated_len_mean": float(lengths[stopped].mean())
        if stopped.any()
        else math.nan,
    }


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float:
    return float(num / den) if float(den) > 0 else 0.0
