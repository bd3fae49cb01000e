"""The collected-batch loop: one collected batch -> ``mu x n_mini`` optimizer steps of their windows' chunks.

This is our "custom Loop": Lightning's loop classes are private, so the nesting lives here,
called from one manual-optimization ``training_step``. The loop passes indices only; the
``ChunkPlan`` materializes each chunk when the loop reaches it. A window's chunk count comes from the
plan (fixed, or data-dependent under a token budget) and is handed to the accumulator before it opens;
``rl.mu_iterations`` epochs walk the same chunks again in the plan's per-epoch mini-batch order.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from lightning_grpo.batch import RolloutBatch
from lightning_grpo.objectives.base import Stats
from lightning_grpo.update.accumulate import DeferredAccumulator, StepOutcome
from lightning_grpo.update.ahead import paired
from lightning_grpo.update.plan import EMPTY, ChunkPlan
from lightning_grpo.update.records import ChunkHook

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

    chunks: list[Stats] = field(default_factory=list)
    chunk_epochs: list[int] = field(default_factory=list)
    """The inner epoch (``rl.mu_iterations``) each entry of ``chunks`` trained in."""
    steps: list[StepOutcome] = field(default_factory=list)
    discarded_chunks: int = 0
    consecutive_skips: int = 0
    """Windows skipped in a row when the batch ended (across loop steps)."""


class NonFiniteRunError(RuntimeError):
    """More optimizer steps in a row were skipped for non-finite values than ``rl.max_consecutive_skips`` allows."""


class CollectedBatchLoop:
    """Walks ``for mini: for micro:`` over a ``ChunkPlan`` and feeds the accumulator.

    Args:
        accumulator: owns backward, the deferred divisor, the countdown and the step.
        forward_chunk: scores one chunk with the objective.
        hooks: per-chunk hooks (``records.ChunkHook``) whose ``scope(k, chunk)`` is entered, in this order, around
            the k-th chunk of the training walk; each may add an auxiliary term to the chunk's loss.
        max_consecutive_skips: raise ``NonFiniteRunError`` once more windows than this are skipped in a
            row (``global_step`` counts only steps taken, so an always-NaN run would never reach
            ``max_steps``); None = never.
    """

    def __init__(
        self,
        accumulator: DeferredAccumulator,
        forward_chunk: ForwardChunk,
        hooks: Sequence[ChunkHook] = (),
        max_consecutive_skips: int | None = None,
    ) -> None:
        self.accumulator = accumulator
        self.forward_chunk = forward_chunk
        self.hooks = list(hooks)
        self.max_consecutive_skips = max_consecutive_skips
        self.progress = LoopProgress()
        # where the last non-finite value came from, for the error
        self.last_nonfinite = ""

    def run(
        self,
        batch: RolloutBatch,
        plan: ChunkPlan,
        pi_old: Sequence[Tensor | None] | None = None,
    ) -> LoopResult:
        """Consume ``batch``. ``pi_old[k]`` is the frozen pi_old of the k-th chunk in walk order (None = detach)."""
        n_calls = sum(1 for _ in plan.training_walk())
        if pi_old is not None and len(pi_old) != n_calls:
            raise ValueError(
                f"pi_old has {len(pi_old)} entries for a plan of {n_calls} chunks"
            )
        acc = self.accumulator
        result = LoopResult()
        k = 0  # k: chunk number in walk order (pi_old pairs by it)
        discarded_before = acc.discarded_chunks
        # one optimizer step each; epochs replay the same chunks
        for epoch, mini in plan.windows():
            window: list[Stats] = []
            acc.open_window(plan.n_chunks(mini))  # data-dependent under a token budget
            # one forward/backward each; the last one steps
            for micro in range(plan.n_chunks(mini)):
                self.progress.epoch = epoch
                self.progress.mini = mini
                self.progress.micro = micro
                if acc.discarding():  # rest of a poisoned window: skip the forward too
                    outcome = acc.discard()
                else:
                    chunk = plan.chunk(batch, mini, micro)
                    # spans backward: a checkpointed recompute sees it too
                    with contextlib.ExitStack() as stack:
                        scopes = [
                            stack.enter_context(hook.scope(k, chunk))
                            for hook in self.hooks
                        ]
                        loss, denom, stats = self.forward_chunk(
                            chunk, paired(pi_old, k, chunk)
                        )
                        # a DP filler trains nothing: it reports nothing either
                        if plan.rows[mini][micro] != EMPTY:
                            window.append(stats)
                        for scope in scopes:  # each hook's auxiliary term, if any
                            loss = scope.loss_with_aux(loss, denom)
                        skipped_before = acc.skipped_steps
                        outcome = acc.train(loss, denom)
                    # this call poisoned the window, or its step was skipped
                    if acc.skipped_steps != skipped_before:
                        self._note_nonfinite(acc, mini, micro)
                k += 1
            self._close(result, window, outcome, mini, epoch)
        # dropped + the non-finite ones
        result.discarded_chunks = acc.discarded_chunks - discarded_before
        result.consecutive_skips = acc.consecutive_skips
        self.progress.loop_step += 1
        return result

    def _note_nonfinite(self, acc: DeferredAccumulator, mini: int, micro: int) -> None:
        step = self.progress.loop_step + 1  # the logged step of the loop step in flight
        if acc.last_skip_cause == "loss":
            self.last_nonfinite = f"non-finite loss in loop step {step}, mini-batch {mini}, micro-batch {micro}"
        else:
            self.last_nonfinite = (
                f"non-finite gradient norm at the optimizer step of loop step {step}, "
                f"mini-batch {mini} (closed by micro-batch {micro})"
            )

    def _close(
        self,
        result: LoopResult,
        window: list[Stats],
        outcome: StepOutcome | None,
        mini: int,
        epoch: int,
    ) -> None:
        # the accumulator steps after the window's calls, from an empty window at each start
        if outcome is None:
            raise RuntimeError(
                f"mini-batch {mini} ended without closing its accumulation window"
            )
        self.progress.optimizer_steps += 1
        result.steps.append(outcome)
        if not outcome.skipped:
            result.chunks.extend(window)
            result.chunk_epochs.extend([epoch] * len(window))
            return
        log.warning("%s: skipped that optimizer step", self.last_nonfinite)
        limit = self.max_consecutive_skips
        run = self.accumulator.consecutive_skips
        if limit is not None and run > limit:
            raise NonFiniteRunError(
                f"rl.max_consecutive_skips={limit}: {run} optimizer steps in a row were skipped for non-finite "
                f"values; the last: {self.last_nonfinite}. Nothing was saved from this loop step: checkpoints hold "
                "batch boundaries with finite parameters. Look for NaN/inf in rewards or advantages, lower optim.lr, "
                "or raise rl.max_consecutive_skips (null = never stop)"
            )
