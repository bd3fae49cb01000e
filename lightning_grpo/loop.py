"""The collected-batch loop: one collected batch -> ``mu x n_mini`` optimizer steps of their windows' chunks.

This is our "custom Loop": Lightning's loop classes are private, so the nesting lives here,
called from one manual-optimization ``training_step``. The loop passes indices only; the
``ChunkPlan`` materializes each chunk when the loop reaches it. A window's chunk count comes from the
plan (fixed, or data-dependent under a token budget) and is handed to the accumulator before it opens;
``rl.mu_iterations`` epochs walk the same chunks again in the plan's per-epoch mini-batch order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from lightning_grpo.accumulate import DeferredAccumulator, StepOutcome
from lightning_grpo.batch import RolloutBatch
from lightning_grpo.chunks import EMPTY, ChunkPlan
from lightning_grpo.objectives.grpo import ChunkStats
from lightning_grpo.old_logprobs import paired

log = logging.getLogger(__name__)

# (chunk, pi_old for it or None) -> (normalized loss, divisor, stats)
ForwardChunk = Callable[[RolloutBatch, Tensor | None], tuple[Tensor, Tensor, ChunkStats]]


@dataclass
class LoopProgress:
    """Named counters of the nesting; saved with checkpoints."""

    loop_step: int = 0
    """Collected batches consumed (Lightning ``training_step`` calls)."""
    optimizer_steps: int = 0
    """Windows closed, stepped or skipped."""
    epoch: int = 0
    """Inner epoch over the current collected batch (``rl.mu_iterations``)."""
    mini: int = 0
    micro: int = 0

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


@dataclass
class LoopResult:
    """What one collected batch produced: stats of the chunks that stepped, and one outcome per window."""

    chunks: list[ChunkStats] = field(default_factory=list)
    chunk_epochs: list[int] = field(default_factory=list)
    """The inner epoch (``rl.mu_iterations``) each entry of ``chunks`` trained in."""
    steps: list[StepOutcome] = field(default_factory=list)
    discarded_chunks: int = 0


class CollectedBatchLoop:
    """Walks ``for mini: for micro:`` over a ``ChunkPlan`` and feeds the accumulator.

    Args:
        accumulator: owns backward, the deferred divisor, the countdown and the step.
        forward_chunk: scores one chunk with the objective.
    """

    def __init__(self, accumulator: DeferredAccumulator, forward_chunk: ForwardChunk) -> None:
        self.accumulator = accumulator
        self.forward_chunk = forward_chunk
        self.progress = LoopProgress()

    def run(self, batch: RolloutBatch, plan: ChunkPlan, pi_old: Sequence[Tensor | None] | None = None) -> LoopResult:
        """Consume ``batch``. ``pi_old[k]`` is the frozen pi_old of the k-th chunk in walk order (None = detach)."""
        n_calls = sum(1 for _ in plan.training_walk())
        if pi_old is not None and len(pi_old) != n_calls:
            raise ValueError(f"pi_old has {len(pi_old)} entries for a plan of {n_calls} chunks")
        acc, result, k = self.accumulator, LoopResult(), 0  # k: chunk number in walk order (pi_old pairs by it)
        discarded_before = acc.discarded_chunks
        for epoch, mini in plan.windows():  # one optimizer step each; epochs replay the same chunks
            window: list[ChunkStats] = []
            acc.open_window(plan.n_chunks(mini))  # data-dependent under a token budget
            for micro in range(plan.n_chunks(mini)):  # one forward/backward each; the last one steps
                self.progress.epoch, self.progress.mini, self.progress.micro = epoch, mini, micro
                if acc.discarding():  # rest of a poisoned window: skip the forward too
                    outcome = acc.discard()
                else:
                    chunk = plan.chunk(batch, mini, micro)
                    loss, denom, stats = self.forward_chunk(chunk, paired(pi_old, k, chunk))
                    if plan.rows[mini][micro] != EMPTY:  # a DP filler trains nothing: it reports nothing either
                        window.append(stats)
                    outcome = acc.train(loss, denom)
                k += 1
            self._close(result, window, outcome, mini, epoch)
        result.discarded_chunks = acc.discarded_chunks - discarded_before  # dropped + the non-finite ones
        self.progress.loop_step += 1
        return result

    def _close(self, result: LoopResult, window: list[ChunkStats], outcome: StepOutcome | None, mini: int,
               epoch: int) -> None:
        if outcome is None:  # the accumulator steps after the window's calls, from an empty window at each start
            raise RuntimeError(f"mini-batch {mini} ended without closing its accumulation window")
        self.progress.optimizer_steps += 1
        result.steps.append(outcome)
        if outcome.skipped:
            log.warning("non-finite loss or gradient: skipped the optimizer step of loop step %d, mini-batch %d",
                        self.progress.loop_step, mini)
        else:
            result.chunks.extend(window)
            result.chunk_epochs.extend([epoch] * len(window))
