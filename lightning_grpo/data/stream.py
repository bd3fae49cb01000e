"""The prompt stream: records with deterministic ids, one list per loop step, sharded over data-parallel ranks.

The stream is one global sequence: epoch ``e`` is the source in the order of a
permutation seeded by ``seed + e``, and stream position ``p`` is epoch ``p // n``,
slot ``p % n``. Loop step ``s`` takes positions ``s*P .. s*P + P - 1`` (``P`` =
``prompts_per_step``); rank ``r`` of ``W`` takes the contiguous slice ``r*P/W ..
(r+1)*P/W - 1`` of them. A prompt's id *is* its position, so ids are unique across
ranks, monotonic, identical in two runs, and a group (one prompt's completions)
never spans two ranks.

A *lane* is a second stream over the same items, shuffled by its own seeds and numbered
with negative ids (position ``q`` is id ``-(q + 1)``), so its records never share an id
with the main stream's: dynamic sampling draws its refills from the ``refill`` lane,
round by round, exactly as loop steps draw from the main one (``rl.dynamic_sampling``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_grpo.data.chat import encode
from lightning_grpo.data.items import TaskItem
from lightning_grpo.rollout.base import Prompt


# not frozen: Lightning's 64-true/16-true/bf16-true input conversion rebuilds dataclasses in a batch
@dataclass
class PromptRecord:
    """One prompt of the stream (treat as read-only)."""

    id: int
    """Global stream position: unique across ranks, the same in every run (the group id of its completions)."""
    text: str
    answer: str | None = None
    """Reference answer for verifiable rewards, if the source has one."""
    meta: dict = field(default_factory=dict)
    """Source extras: ``source_index`` (row in the source), ``epoch``, and the row's other columns."""
    messages: list[dict] | None = None
    """Chat messages of a conversational prompt; None = plain text."""
    images: tuple = ()
    """Image references (paths, bytes, PIL images) in the order of the messages' image parts; decoded only when
    the prompt is generated from or one of its chunks is scored (``data/images.py``)."""

    def to_prompt(self, tokenizer) -> Prompt:
        """The engine's ``Prompt``: chat-templated when it has messages, else ``chat.encode_prompt`` (the encoding
        ``warm_start`` trains on). Image placeholders stay single tokens until ``vision.VisionProcessor`` expands
        them."""
        ids, text = encode(tokenizer, self.text, self.messages)
        return Prompt(
            self.id,
            ids,
            text,
            self.answer,
            self.meta,
            self.messages,
            tuple(self.images),
        )

    @classmethod
    def of(cls, position: int, item: TaskItem, **extra: Any) -> PromptRecord:
        """The record at stream position (or held-out index) ``position`` of ``item``; ``extra`` joins its meta."""
        return cls(
            position,
            item.text,
            item.answer,
            {**extra, **item.meta},
            item.messages,
            item.images,
        )


class PromptStream:
    """The global prompt stream over ``items`` (see the module docstring); pure, no state.

    ``rows[i]`` is item i's row in the source (``source_index``); None = its position in ``items``. ``lane``: "" = the
    main stream; a name = a lane (its own shuffle, negative ids).
    """

    def __init__(
        self,
        items: Sequence[TaskItem],
        seed: int = 0,
        shuffle: bool = True,
        rows: Sequence[int] | None = None,
        lane: str = "",
    ) -> None:
        self.items = items
        self.seed = seed
        self.shuffle = shuffle
        self.rows = rows
        self.lane = lane
        self._orders: dict[int, list[int]] = {}

    def record(self, position: int) -> PromptRecord:
        epoch, slot = divmod(position, len(self.items))
        index = self._order(epoch)[slot]
        row = index if self.rows is None else self.rows[index]
        # a lane's ids never meet the main stream's
        record_id = -(position + 1) if self.lane else position
        return PromptRecord.of(
            record_id, self.items[index], source_index=row, epoch=epoch
        )

    def step(
        self, step: int, prompts_per_step: int, rank: int = 0, world_size: int = 1
    ) -> list[PromptRecord]:
        """Rank ``rank``'s share of loop step ``step``: ids ``step*P + rank*P/W + i``."""
        per_rank = prompts_per_step // world_size
        start = step * prompts_per_step + rank * per_rank
        return [self.record(p) for p in range(start, start + per_rank)]

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.items)))
            if self.shuffle:
                random.Random(
                    f"{self.lane}/{self.seed + epoch}"
                    if self.lane
                    else self.seed + epoch
                ).shuffle(order)
            # one epoch cached: a step spans at most two, each built once per epoch
            self._orders = {epoch: order}
        return self._orders[epoch]
