"""Per-row records of one collected batch: what the ahead pass measures once and training reads back per chunk.

A record is kept per *row* of the collected batch, not per chunk: a training chunk need not be an ahead
chunk (a token-budgeted ahead pass walks bigger chunks of its own, inner epochs revisit the rows in another
window order), so each training chunk lays its record out from its rows with ``RowRecords.layout``, the one
layout function every kind of record uses. Rows are packed from position 0, so token ``t`` of a row sits at
position ``t`` in every chunk; past a row's own tokens a record is zero (nothing reads it there).

Kinds today: pi_old (``[T]`` logprobs per row, token axis 0) and each recorder's own. A new per-token record is a
``Recorder``: see docs/update.md. A recorder that training reads back chunk by chunk is a ``ChunkHook``: it declares
what it needs of the batch (``HookNeeds``), is handed its records when the update begins, and gives a context entered
around each training chunk's forward and backward, and one around the probe's re-score.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from lightning_grpo.batch import RolloutBatch


class RowRecords:
    """One kind of record: ``row -> tensor`` holding that row's tokens along ``token_dim``.

    Args:
        token_dim: the token axis of a row's tensor; a laid-out chunk has its row axis inserted there.
    """

    def __init__(self, token_dim: int = 0) -> None:
        self.token_dim = token_dim
        self.by_row: dict[int, Tensor] = {}

    def put(self, rows: Sequence[int], per_row: Iterable[Tensor]) -> None:
        self.by_row.update(zip(rows, per_row))

    def drop(self, rows: Iterable[int]) -> None:
        for r in rows:
            self.by_row.pop(r, None)

    def covers(self, rows: Sequence[int]) -> bool:
        """Every row of ``rows`` has a record (and there is at least one row)."""
        return bool(rows) and all(r in self.by_row for r in rows)

    def layout(self, rows: Sequence[int], width: int) -> Tensor:
        """The record of a chunk of ``rows`` that is ``width`` tokens wide: rows stacked at ``token_dim``, each row's
        tokens from position 0, zeros past them and for rows without a record. Built where the records live."""
        some = next(t for r in rows if (t := self.by_row.get(r)) is not None)
        d = self.token_dim
        shape = list(some.shape)
        shape[d] = width
        shape.insert(d, len(rows))  # e.g. [T] -> [B, W]; [L, T, k] -> [L, B, W, k]
        out = some.new_zeros(shape)
        for i, r in enumerate(rows):
            row = self.by_row.get(r)
            if row is not None:
                n = min(width, row.shape[d])
                out.select(d, i).narrow(d, 0, n).copy_(row.narrow(d, 0, n))
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.by_row.values())


class Capture(Protocol):
    """What a recorder's context yields: ``value`` holds the chunk's record once the forward has run."""

    value: Any


class Recorder(Protocol):
    """A per-token record the ahead pass takes alongside pi_old, on every chunk it scores.

    ``capture()`` is entered around the ahead forward of one chunk; ``split`` turns the captured value into one
    tensor per row (the row's own tokens on ``token_dim``), which the pass stores in ``records[name]``.
    """

    name: str
    token_dim: int

    def capture(self) -> AbstractContextManager[Capture]: ...

    def split(
        self, value: Any, rows: Sequence[int], lengths: Sequence[int]
    ) -> list[Tensor]: ...


@dataclass(frozen=True)
class HookNeeds:
    """What a ``ChunkHook`` asks of one collected batch (``plan.batch_needs`` folds it into ``Needs``)."""

    ahead_pass: bool = False
    """Walk the batch ahead even when no pi_old is frozen (its record must exist before the first backward)."""
    every_chunk: bool = False
    """Record every chunk: mini-batch 0 may not go unrecorded (its scope reads every chunk's record)."""


class ChunkLoss(Protocol):
    """What ``ChunkHook.scope`` yields: it may add an auxiliary term to the chunk's loss."""

    def loss_with_aux(self, loss: Tensor, denom: Tensor) -> Tensor:
        """``loss`` plus this chunk's auxiliary term (``denom``: the chunk's divisor), or ``loss`` itself."""
        ...


class ChunkHook(Recorder, Protocol):
    """A ``Recorder`` whose records training reads back: driven by the ``Updater`` around every chunk.

    Per collected batch: ``needs`` before the plan, ``capture``/``split`` on every ahead chunk, ``replay`` around
    the probe's train() re-score of the first one (once per run), ``begin`` once the ahead pass is done, then
    ``scope(k, chunk)`` around the k-th chunk of the training walk (every epoch), through its forward *and*
    backward (a checkpointed layer re-runs its forward in backward).
    """

    def needs(self, several_chunks: bool) -> HookNeeds:
        """What this batch needs; ``several_chunks``: a window may take several chunks (``plan.several_chunks``)."""
        ...

    def replay(self, record: Any) -> AbstractContextManager:
        """Entered around the probe's train() re-score of the chunk whose ``capture`` gave ``record`` (its value)."""
        ...

    def begin(self, batch: RolloutBatch, plan, records: RowRecords | None) -> None:
        """An update of ``batch`` cut by ``plan`` (its ``ChunkPlan``, every epoch) starts, once the ahead pass is
        done; ``records`` are this hook's per-row records (None: no ahead pass ran)."""
        ...

    def scope(self, k: int, chunk: RolloutBatch) -> AbstractContextManager[ChunkLoss]:
        """Entered around chunk ``k`` of the training walk: its forward, the objective and its backward."""
        ...
