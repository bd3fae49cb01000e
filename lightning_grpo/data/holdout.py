"""The held-out prompts: which rows of a source validation holds out, and how they are dealt into validation steps."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_grpo.data.items import TaskItem
from lightning_grpo.data.sources import PromptDataError, load_items
from lightning_grpo.data.stream import PromptRecord

HOLDOUT_SEED = 0
"""Seed of the rows a file/dataset source holds out for validation: the same held-out set for every run seed."""


def load_held_out(
    source: str | Sequence[Mapping[str, Any]],
    val_source: str | Sequence[Mapping[str, Any]] | None,
    split: str,
    val_split: str | None,
    val_size: int,
    load: dict[str, Any],
) -> list[TaskItem] | None:
    """Held-out items from their own source or split; None = hold ``val_size`` rows out of ``source``
    (``hold_out``). ``load``: the keys, template and seed ``load_items`` reads the training items with."""
    if val_size == 0:
        return []
    if val_source is not None:
        return load_items(
            val_source, size=val_size, dataset_split=val_split or split, **load
        )[:val_size]
    if isinstance(source, str) and source.startswith("builtin:"):
        return load_items(source, size=val_size, split="val", **load)
    if val_split is not None:
        return load_items(source, dataset_split=val_split, **load)[:val_size]
    return None


def hold_out(
    items: list[TaskItem], rows: list[int], val_size: int, source_name: str
) -> tuple[list[TaskItem], list[int], list[TaskItem]]:
    """``val_size`` items drawn with a fixed seed (the same set for every run seed); the rest train."""
    if val_size >= len(items):
        raise PromptDataError(
            f"data.val_size={val_size}: would hold out all {len(items)} prompts of "
            f"source={source_name} for validation, leaving none to train on. Lower --data.val_size "
            "(0 = no validation) or give --data.val_source / --data.val_split"
        )
    order = list(range(len(items)))
    random.Random(HOLDOUT_SEED).shuffle(order)
    held = set(order[:val_size])
    train = [i for i in range(len(items)) if i not in held]
    return (
        [items[i] for i in train],
        [rows[i] for i in train],
        [items[i] for i in sorted(held)],
    )


def val_batches(
    items: list[TaskItem], prompts_per_step: int, rank: int, world_size: int
) -> list[list[PromptRecord]]:
    """Rank ``rank``'s held-out prompts, one list per validation step; ids are held-out indices.

    The last step wraps around to the start, so every rank gets the same number of equal lists
    (uneven ranks would hang a distributed validation loop); wrapped prompts repeat their ids.
    """
    per_rank = prompts_per_step // world_size
    n = len(items)
    batches = []
    for step in range(-(-n // prompts_per_step) if n else 0):
        start = step * prompts_per_step + rank * per_rank
        ids = [(start + i) % n for i in range(per_rank)]
        batches.append([PromptRecord.of(i, items[i], source_index=i) for i in ids])
    return batches
