"""ChunkPlan: which rows of this rank's share make up chunk ``(mini, micro)``.

The plan is computed once per collected batch and then only indexed, so the ahead pass
and the training walk see the very same chunks in the very same order. The fixed plan
cuts contiguous, equal row counts; a token-budgeted plan (unequal row counts chosen by
token cost) fits the same shape, and the deferred divisor keeps any chunking exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lightning_grpo.batch import RolloutBatch


class BatchSizeError(ValueError):
    """The collected batch does not have the size the config promises."""


@dataclass(frozen=True)
class ChunkPlan:
    """Row indices of every chunk: ``rows[mini][micro]`` is a tuple of row numbers."""

    rows: tuple[tuple[tuple[int, ...], ...], ...]

    @classmethod
    def fixed(cls, n_rows: int, n_mini: int, n_micro: int, expected_rows: int | None = None) -> ChunkPlan:
        """Contiguous equal chunks; refuses a batch whose size disagrees with the config."""
        if expected_rows is not None and n_rows != expected_rows:
            raise BatchSizeError(
                f"collected batch has {n_rows} trajectories on this rank but the config expects {expected_rows} "
                "(rl.batch_per_replica / DP size); check the engine returned group_size completions per prompt"
            )
        if n_rows % (n_mini * n_micro):
            raise BatchSizeError(
                f"collected batch of {n_rows} trajectories does not split into n_mini={n_mini} x n_micro={n_micro} "
                "equal chunks"
            )
        size = n_rows // (n_mini * n_micro)
        return cls(tuple(
            tuple(tuple(range((mi * n_micro + mc) * size, (mi * n_micro + mc + 1) * size)) for mc in range(n_micro))
            for mi in range(n_mini)
        ))

    @property
    def n_mini(self) -> int:
        return len(self.rows)

    @property
    def n_micro(self) -> int:
        return len(self.rows[0])

    def walk(self) -> Iterator[tuple[int, int]]:
        """Every ``(mini, micro)`` in training order."""
        for mini in range(self.n_mini):
            for micro in range(self.n_micro):
                yield mini, micro

    def chunk(self, batch: RolloutBatch, mini: int, micro: int) -> RolloutBatch:
        """Materialize exactly chunk ``(mini, micro)`` of ``batch``, trimmed to its longest sequence."""
        rows = self.rows[mini][micro]
        if len(rows) == rows[-1] - rows[0] + 1:  # contiguous: a view, no gather
            return batch.select(slice(rows[0], rows[-1] + 1))
        return batch.select(torch.tensor(rows, dtype=torch.long))
