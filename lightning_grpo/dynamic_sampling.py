"""DAPO's dynamic sampling (arXiv 2503.14476, section 3.2): a collected batch of informative groups only.

A group whose rewards all agree has advantage 0 on every row: it adds tokens to the divisor and nothing to the
gradient. ``fill`` keeps the groups whose rewards differ, in draw order, and draws refill rounds (further prompts
from the datamodule's refill lane, ``data/stream.py``) until this rank holds ``needed`` of them or
``max_refill_rounds`` rounds were drawn. Rounds are agreed over data-parallel ranks (one all-reduce per round):
every rank keeps drawing while any rank is short, so every rank's refill cursor advances alike; a rank that is
already full leaves its share of a round ungenerated.

A batch still short trains on what there is: it pads with the groups it dropped (or a skipped bad record's
placeholder rows), whose rows are not *trained*: their completion tokens leave the loss and every divisor, as a
skipped record's do, so the step is exactly the step of the informative groups alone. The batch keeps the config's
size, so every plan and split stays valid. Never more than ``max_refill_rounds`` rounds: no endless loop.

The rest of the file is what decides which completion tokens of a collected batch count: trained rows only, and
under ``rl.mask_truncated_completions`` only completions that ended on EOS or a stop string; plus the overlong
penalty (DAPO's soft punishment) that shapes rewards before the advantages, and the completion metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_grpo.batch import RolloutBatch
from lightning_grpo.data.rewards import overlong_penalty
from lightning_grpo.metrics import length_metrics
from lightning_grpo.rollout.base import Rollout


@dataclass(frozen=True)
class Groups:
    """Whole groups of one draw, ``group_size`` contiguous rows each (``N = groups x group_size``)."""

    rollouts: list[Rollout]
    """``[N]`` completions, prompt 0's group first."""
    rewards: Tensor
    """``[N]`` float32 rewards (shaped: the overlong penalty is in)."""
    live: Tensor
    """``[N]`` bool: rows with a real completion (False: a skipped bad record's placeholder)."""
    trained: Tensor
    """``[N]`` bool: rows the loss learns from (live, and not a padding group under dynamic sampling)."""

    def group(self, g: int, group_size: int, trained: bool) -> Groups:
        rows = slice(g * group_size, (g + 1) * group_size)
        live = self.live[rows]
        return Groups(self.rollouts[rows], self.rewards[rows], live, live & trained)


@dataclass
class Refill:
    """What one loop step's dynamic sampling did on this rank (logged as ``data/dynamic_*``)."""

    groups_dropped: int = 0
    """Zero-variance groups drawn and not trained on (round 0 and refills)."""
    rounds: int = 0
    """Refill rounds drawn (the same on every rank)."""
    prompts_drawn: int = 0
    """Refill prompts generated on this rank."""
    short: int = 0
    """Informative groups missing from this rank's batch (padded)."""

    def metrics(self) -> dict[str, float]:
        return {"data/dynamic_groups_dropped": float(self.groups_dropped),
                "data/dynamic_refill_rounds": float(self.rounds),
                "data/dynamic_prompts_drawn": float(self.prompts_drawn), "data/dynamic_batch_short": float(self.short)}


def informative(rewards: Tensor, group_size: int) -> Tensor:
    """``[P]`` bool: groups whose rewards are not all equal (``max != min``, as ``reward/frac_zero_std`` counts)."""
    grouped = rewards.view(-1, group_size)  # [P, G]
    return grouped.amax(dim=1) != grouped.amin(dim=1)


def fill(first: Groups, group_size: int, needed: int, max_rounds: int, draw: Callable[[bool], Groups | None],
         total_short: Callable[[int], int]) -> tuple[Groups, Refill]:
    """``needed`` groups: the informative ones of ``first`` and of refill rounds, padded when rounds run out.

    Args:
        first: the loop step's own groups (rewards shaped, bad records as placeholders).
        group_size: rows per group.
        needed: groups in this rank's batch (``prompts_per_batch / dp_size``).
        max_rounds: ``rl.max_refill_rounds``.
        draw: one refill round on this rank: ``draw(True)`` generates and scores this rank's share; ``draw(False)``
            only advances the cursor (this rank is full) and returns None.
        total_short: this rank's missing groups -> their sum over ranks (an all-reduce: every rank calls it alike).
    """
    kept, spare, counts = [], [], Refill()

    def sort(groups: Groups) -> None:
        good = informative(groups.rewards, group_size) & groups.live.view(-1, group_size).all(dim=1)  # [P]
        for g, ok in enumerate(good.tolist()):
            (kept if ok else spare).append(groups.group(g, group_size, trained=ok))
            counts.groups_dropped += int(not ok and bool(groups.live[g * group_size]))

    sort(first)
    short = total_short(max(needed - len(kept), 0))
    while short > 0 and counts.rounds < max_rounds:
        counts.rounds += 1
        more = draw(len(kept) < needed)
        if more is not None:
            counts.prompts_drawn += len(more.rollouts) // group_size
            sort(more)
        short = total_short(max(needed - len(kept), 0))
    counts.short = max(needed - len(kept), 0)
    if short > 0:
        rank_zero_warn(f"rl.dynamic_sampling: {short} informative group(s) short over all ranks after "
                       f"{counts.rounds} refill round(s) (rl.max_refill_rounds={max_rounds}; this rank found "
                       f"{min(len(kept), needed)} of {needed}); training on what there is, the rest padded with groups "
                       "that count in no divisor. More rounds, or easier prompts, fill it")
    kept = kept[:needed]
    return _cat(kept + spare[: needed - len(kept)]), counts  # round 0 alone has `needed` groups: enough to pad


def _cat(groups: list[Groups]) -> Groups:
    return Groups([r for g in groups for r in g.rollouts], torch.cat([g.rewards for g in groups]),
                  torch.cat([g.live for g in groups]), torch.cat([g.trained for g in groups]))


# -- the rows that count ---------------------------------------------------------------------------------------------
def overlong_of(rollouts: list[Rollout], rl, max_new_tokens: int) -> Tensor:
    """``[N]`` the overlong penalty of each completion under ``rl.overlong_buffer`` / ``rl.overlong_penalty``."""
    # an episode's length is its model tokens: tool results are not the policy's verbosity
    lengths = torch.tensor([len(r.token_ids) if r.model_mask is None else sum(r.model_mask) for r in rollouts],
                           dtype=torch.long)
    return overlong_penalty(lengths, max_new_tokens, rl.overlong_buffer, rl.overlong_penalty)


def counted_only(batch: RolloutBatch, groups: Groups, mask_truncated: bool) -> RolloutBatch:
    """``batch`` with completion tokens only on trained rows (and, under ``mask_truncated``, only on completions that
    ended on EOS or a stop string): the others leave the loss and every divisor. Their rewards already counted in
    their group's advantages (TRL's ``mask_truncated_completions``)."""
    counted = groups.trained
    if mask_truncated:
        counted = counted & ~truncated(groups.rollouts)
    if bool(counted.all()):
        return batch
    return replace(batch, completion_mask=batch.completion_mask & counted[:, None])


def truncated(rollouts: list[Rollout]) -> Tensor:
    """``[N]`` bool: completions cut at ``max_new_tokens`` (finish reason ``length``), not ended by EOS or a stop."""
    return torch.tensor([r.finish_reason == "length" for r in rollouts], dtype=torch.bool)


def completion_metrics(groups: Groups, batch: RolloutBatch, rl, max_new_tokens: int) -> dict[str, float]:
    """Lengths and endings of the real completions (placeholders left out), and what shaping did to them."""
    live = groups.live
    reasons = [r.finish_reason for r, real in zip(groups.rollouts, live.tolist()) if real]
    out = length_metrics(batch.completion_mask.sum(-1)[live], reasons)
    if rl.overlong_buffer:
        out["reward/overlong_penalty_mean"] = float(overlong_of(groups.rollouts, rl, max_new_tokens)[live].mean())
    if rl.mask_truncated_completions:  # trained rows whose completion leaves the loss
        out["completion/truncated_masked"] = float((truncated(groups.rollouts) & groups.trained)[live].sum())
    return out


def scatter(values: Tensor, keep: Tensor) -> Tensor:
    """``[len(keep)]``: ``values`` at the kept rows, 0 at the others."""
    out = values.new_zeros(keep.shape)
    out[keep] = values
    return out
