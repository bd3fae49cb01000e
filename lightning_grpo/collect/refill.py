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
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from lightning_grpo.collect.groups import Groups, concat


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
        return {
            "data/dynamic_groups_dropped": float(self.groups_dropped),
            "data/dynamic_refill_rounds": float(self.rounds),
            "data/dynamic_prompts_drawn": float(self.prompts_drawn),
            "data/dynamic_batch_short": float(self.short),
        }


def informative(rewards: Tensor, group_size: int) -> Tensor:
    """``[P]`` bool: groups whose rewards are not all equal (``max != min``, as ``reward/frac_zero_std`` counts)."""
    grouped = rewards.view(-1, group_size)  # [P, G]
    return grouped.amax(dim=1) != grouped.amin(dim=1)


def fill(
    first: Groups,
    group_size: int,
    needed: int,
    max_rounds: int,
    draw: Callable[[bool], Groups | None],
    total_short: Callable[[int], int],
    rank: int = 0,
) -> tuple[Groups, Refill]:
    """``needed`` groups: the informative ones of ``first`` and of refill rounds, padded when rounds run out.

    Args:
        first: the loop step's own groups (rewards shaped, bad records as placeholders).
        group_size: rows per group.
        needed: groups in this rank's batch (``prompts_per_batch / dp_size``).
        max_rounds: ``rl.max_refill_rounds``.
        draw: one refill round on this rank: ``draw(True)`` generates and scores this rank's share; ``draw(False)``
            only advances the cursor (this rank is full) and returns None.
        total_short: this rank's missing groups -> their sum over ranks (an all-reduce: every rank calls it alike).
        rank: this data-parallel rank (rank 0 alone warns when the batch stays short).
    """
    kept = []
    spare = []
    counts = Refill()

    def sort(groups: Groups) -> None:
        # [P]
        good = informative(groups.rewards, group_size) & groups.live.view(
            -1, group_size
        ).all(dim=1)
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
    if short > 0 and rank == 0:
        warnings.warn(
            f"rl.dynamic_sampling: {short} informative group(s) short over all ranks after "
            f"{counts.rounds} refill round(s) (rl.max_refill_rounds={max_rounds}; this rank found "
            f"{min(len(kept), needed)} of {needed}); training on what there is, the rest padded with groups "
            "that count in no divisor. More rounds, or easier prompts, fill it",
            UserWarning,
            stacklevel=2,
        )
    kept = kept[:needed]
    # round 0 alone has `needed` groups: enough to pad
    return concat(kept + spare[: needed - len(kept)]), counts
