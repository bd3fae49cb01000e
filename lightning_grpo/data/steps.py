"""Per-step datasets: one list of records (prompts, preference pairs) per loop step, handed to Lightning as is."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from torch.utils.data import DataLoader, IterableDataset


class Positioned(Protocol):
    """What a per-step dataset starts from: a datamodule's stream position."""

    @property
    def position(self) -> int:
        """Loop steps of records drawn so far."""
        ...


class Steps(IterableDataset):
    """Yields one list of records per loop step, forever, from ``stream.position`` on (read when iteration begins,
    so a resumed run starts at its checkpoint's position)."""

    def __init__(self, records: Callable[[int], list], stream: Positioned) -> None:
        self._records = records
        self._stream = stream

    def __iter__(self) -> Iterator[list]:
        step = self._stream.position
        while True:
            yield self._records(step)
            step += 1


class Fixed(IterableDataset):
    """A finite, already sharded list of per-step record lists (validation)."""

    def __init__(self, batches: list[list]) -> None:
        self._batches = batches

    def __iter__(self) -> Iterator[list]:
        return iter(self._batches)


def as_is(batch: Any) -> Any:
    """The collate function of a per-step dataset: the step's list is the batch."""
    return batch


def step_loader(dataset) -> DataLoader:
    """A loader over per-step lists (a ``Steps``, a ``Fixed`` or a plain list) that hands each over uncollated."""
    return DataLoader(dataset, batch_size=None, collate_fn=as_is)
