"""The collected-batch loop: one collected batch -> ``n_mini`` optimizer steps of ``n_micro`` chunks.

This is our "custom Loop": Lightning's loop classes are private, so the nesting lives here,
called from one manual-optimization ``training_step``. The loop passes indices only; the
``ChunkPlan`` materializes each chunk when the loop reaches it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from lightning_grpo.accumulate import DeferredAccumulator, StepOutcome
from lightning_grpo.batch import RolloutBatch
from lightning_grpo.chunks import ChunkPlan
from lightning_grpo.objectives.base import Stats
from lightning_grpo.old_logprobs import paired

log = logging.getLogger(__name__)

# (chunk, pi_old for it or None) -> (normalized loss, divisor, stats); any objective (objectives/base.py)
ForwardChunk = Callable[[RolloutBatch, Tensor | None], tuple[Tensor, Tensor, Stats]]


@dataclass
class LoopProgress:
    """Named counters of the nesting; saved with checkpoints."""

    loop_step: int = 0
    """Collected batches consumed (Lightning ``training_step`` calls)."""
    optimizer_steps: int = 0
    """Windows closed, stepped or skipped."""
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

    chunks: list[Stats] = field(default_factory=list)
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
        if plan.n_micro != self.accumulator.grad_accum:
            raise ValueError(f"plan has n_micro={plan.n_micro} but the accumulator steps every "
                             f"{self.accumulator.grad_accum} calls")
        if pi_old is not None and len(pi_old) != plan.n_mini * plan.n_micro:
            raise ValueError(f"pi_old has {len(pi_old)} entries for a plan of {plan.n_mini * plan.n_micro} chunks")
        acc, result, k = self.accumulator, LoopResult(), 0  # k: chunk number in walk order (pi_old pairs by it)
        discarded_before = acc.discarded_chunks
        for mini in range(plan.n_mini):  # one optimizer step each
            window: list[Stats] = []
            for micro in range(plan.n_micro):  # one forward/backward each; the last one steps
                self.progress.mini, self.progress.micro = mini, micro
                if acc.discarding():  # rest of a poisoned window: skip the forward too
                    outcome = acc.discard()
                else:
                    chunk = plan.chunk(batch, mini, micro)
                    loss, denom, stats = self.forward_chunk(chunk, paired(pi_old, k, chunk))
                    window.append(stats)
                    outcome = acc.train(loss, denom)
                k += 1
            self._close(result, window, outcome, mini)
        result.discarded_chunks = acc.discarded_chunks - discarded_before  # dropped + the non-finite ones
        self.progress.loop_step += 1
        return result

    def _close(self, result: LoopResult, window: list[Stats], outcome: StepOutcome | None, mini: int) -> None:
        if outcome is None:  # the accumulator steps every n_micro calls, from an empty window at each batch start
            raise RuntimeError(f"mini-batch {mini} ended without closing its accumulation window")
        self.progress.optimizer_steps += 1
        result.steps.append(outcome)
        if outcome.skipped:
            log.warning("non-finite loss or gradient: skipped the optimizer step of loop step %d, mini-batch %d",
                        self.progress.loop_step, mini)
        else:
            result.chunks.extend(window)
