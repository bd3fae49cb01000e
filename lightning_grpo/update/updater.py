"""The Updater: one collected batch in, ``mu_iterations x n_mini`` optimizer steps out. No Lightning in here.

One update, in call order (docs/update.md draws it):

1. ``plan``: the ``ChunkPlan`` of this batch (fixed or token-budgeted chunks, every inner epoch's window order), and
   the ahead pass's own plan when it has a token budget of its own. Computed once, only indexed afterwards.
2. ``AheadPass.compute``: when ``Needs`` says so, one no-grad walk records frozen pi_old and every hook's and
   recorder's per-token record per row; the probe runs on its first chunk, once per run.
3. ``ChunkHook.begin`` for every hook: its records of this batch.
4. ``CollectedBatchLoop.run``: ``for window: for chunk:`` (inside every hook's ``scope``) forward -> objective ->
   ``DeferredAccumulator.train``; the window's last chunk scales by ``1 / sum(denom)``, clips and steps.

A Lightning module builds one Updater in ``configure_model``, attaches the optimizer in ``on_train_start`` and calls
``update`` from ``training_step``; a test drives it with a bare model and optimizer the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from torch import Tensor, nn

from lightning_grpo.distributed import single_process
from lightning_grpo.timing import AHEAD, StepTimer
from lightning_grpo.update.accumulate import DeferredAccumulator
from lightning_grpo.update.ahead import AheadPass
from lightning_grpo.update.loop import CollectedBatchLoop, ForwardChunk, LoopResult
from lightning_grpo.update.plan import ChunkPlan, Needs, plan_update
from lightning_grpo.update.records import ChunkHook


@dataclass(frozen=True)
class Split:
    """How a collected batch is cut into windows and chunks (``GRPOConfig`` derives it: ``Split.of(rl, dp_size)``)."""

    rows: int | None = None
    """Rows this rank's share must have (None: not checked)."""
    n_mini: int = 1
    """Optimizer steps per epoch over the batch."""
    n_micro: int = 1
    """Chunks per window (ignored under a token budget)."""
    max_tokens_per_micro: int = 0
    """Token budget per chunk; 0 = fixed ``n_micro`` chunks."""
    ahead_budget: int = 0
    """Token budget per ahead-pass chunk; 0 = the ahead pass walks the training chunks."""
    mu_iterations: int = 1
    """Inner epochs over the same chunks (``rl.mu_iterations``)."""
    packed: bool = False
    """Chunks are packed (``rl.packed`` resolved for the policy): a token budget counts real tokens only."""

    @classmethod
    def of(cls, rl, dp_size: int = 1, packed: bool = False) -> Split:
        return cls(
            rl.rank_sizes(dp_size).batch,
            rl.n_mini,
            rl.n_micro,
            rl.max_tokens_per_micro,
            rl.ahead_budget,
            rl.mu_iterations,
            packed,
        )


@dataclass(frozen=True)
class DataParallel:
    """The data-parallel operations one update needs; the defaults are a single process's."""

    max: Callable[[Tensor], Tensor] = single_process
    """Element-wise max over ranks of an int64 vector (the token-budgeted chunk counts)."""
    grad_sync: Callable[[bool], AbstractContextManager] | None = None
    """``grad_sync(enabled)``: context of one backward; False skips the gradient all-reduce of a non-final chunk."""
    all_finite: Callable[[Tensor], bool] | None = None
    """Whether a loss is finite on every rank (every rank then poisons the same window)."""


NOTHING = Needs()
"""The default: a batch that needs no ahead pass."""
ONE_PROCESS = DataParallel()
"""The default: a single process."""


class Updater:
    """Owns one update: the plan, the ahead pass and its records, the loop, the accumulator.

    Args:
        policy: the trained model (its trainable parameters are stepped).
        forward_chunk: ``(chunk, pi_old or None) -> (loss, denom, stats)``: the objective on one chunk.
        split: how a batch is cut (a Trainer's per-rank split replaces it in ``attach``).
        needs: what a batch needs before training (``plan.batch_needs``).
        ahead: the ahead pass (required when ``needs`` asks for one).
        hooks: per-chunk hooks (``records.ChunkHook``): told each batch's records, their scopes entered around every
            training chunk in this order (the same hooks the ahead pass records first).
        seed: seeds the later inner epochs' window order (with the loop step).
        dp: data-parallel operations (a Trainer's replace them in ``attach``).
        max_grad_norm: clip threshold (0 = no clipping).
        max_consecutive_skips: stop after more non-finite windows in a row than this (None = never).
        timer: the loop step's timer: the ahead pass is its phase ``ahead`` (None: a timer of its own).

    Example::

        updater = Updater(policy, forward_chunk, Split(n_mini=2, n_micro=4), Needs(pi_old=True), AheadPass(policy, score))
        updater.attach(torch.optim.AdamW(policy.parameters()))
        result = updater.update(batch)
    """

    def __init__(
        self,
        policy: nn.Module,
        forward_chunk: ForwardChunk,
        split: Split,
        needs: Needs = NOTHING,
        ahead: AheadPass | None = None,
        hooks: Sequence[ChunkHook] = (),
        seed: int = 0,
        dp: DataParallel = ONE_PROCESS,
        max_grad_norm: float = 0.0,
        max_consecutive_skips: int | None = None,
        timer: StepTimer | None = None,
    ) -> None:
        self.policy = policy
        self.forward_chunk = forward_chunk
        self.split = split
        self.needs = needs
        self.ahead = ahead
        self.hooks: list[ChunkHook] = list(hooks)
        self.seed = seed
        self.dp = dp
        self.max_grad_norm = max_grad_norm
        self.max_consecutive_skips = max_consecutive_skips
        self.timer = timer if timer is not None else StepTimer()
        # built by attach, once the optimizer exists
        self.loop: CollectedBatchLoop | None = None
        self.last_plan: ChunkPlan | None = None
        """The ChunkPlan of the last collected batch (metrics, tests)."""

    @property
    def loop_step(self) -> int:
        """Collected batches consumed so far."""
        return self.loop.progress.loop_step if self.loop is not None else 0

    def attach(
        self,
        optimizer,
        scheduler=None,
        backward=None,
        step=None,
        clip=None,
        split: Split | None = None,
        dp: DataParallel | None = None,
    ) -> CollectedBatchLoop:
        """Build the accumulator and loop around ``optimizer`` (``scheduler`` stepped with it). ``backward``, ``step``
        and ``clip`` default to plain torch; under a Trainer they go through the precision plugin, and ``split`` and
        ``dp`` are the ranks' (known only once the strategy is set up: a part decided earlier would plan one rank's
        chunk counts while the others plan theirs, and the ranks hang in their collectives)."""
        if split is not None:
            self.split = split
        if dp is not None:
            self.dp = dp
        acc = DeferredAccumulator(
            self.policy.parameters(),
            optimizer,
            grad_accum=self.split.n_micro,
            max_grad_norm=self.max_grad_norm,
            backward=backward,
            scheduler=scheduler,
            grad_sync=self.dp.grad_sync,
            all_finite=self.dp.all_finite,
            step=step,
            clip=clip,
        )
        self.loop = CollectedBatchLoop(
            acc,
            self.forward_chunk,
            self.hooks,
            max_consecutive_skips=self.max_consecutive_skips,
        )
        return self.loop

    def update(self, batch) -> LoopResult:
        """Consume one collected batch (this rank's share): plan -> ahead pass -> windows of chunks."""
        if self.loop is None:
            raise RuntimeError(
                "Updater.update before Updater.attach(optimizer): there is nothing to step"
            )
        needs = self.needs
        plan, ahead = self.plan(batch, needs)
        self.last_plan = plan
        # pi_old per chunk in walk order, frozen before the first step; None = no ahead pass (n_mini == 1, ...).
        pi_old = None
        if needs.ahead_pass:
            with self.timer.phase(AHEAD):
                pi_old = self.ahead.compute(batch, plan, needs, ahead)
        # each hook's records of this batch, read back chunk by chunk in training
        for hook in self.hooks:
            hook.begin(
                batch,
                plan,
                self.ahead.records.get(hook.name) if needs.ahead_pass else None,
            )
        return self.loop.run(batch, plan, pi_old if needs.pi_old else None)

    def plan(
        self, batch, needs: Needs | None = None
    ) -> tuple[ChunkPlan, ChunkPlan | None]:
        """The ChunkPlan of this collected batch (every epoch) and the ahead pass's own, computed once and shared by
        the ahead pass and the training walk. Token-budgeted counts are agreed over ranks in one all-reduce."""
        s = self.split
        needs = needs or self.needs
        ahead_rows = None
        if needs.pi_old and s.ahead_budget:
            first = (
                len(batch) // s.n_mini
                if self.ahead.skips_first_mini(needs, s.mu_iterations)
                else 0
            )
            ahead_rows = list(range(first, len(batch)))
        plan, ahead = plan_update(
            batch,
            s.n_mini,
            s.n_micro,
            s.max_tokens_per_micro,
            ahead_rows,
            s.ahead_budget,
            self.dp.max,
            expected_rows=s.rows,
            packed=s.packed,
        )
        # the later epochs' mini-batch order: the same on every rank, new every loop step
        if s.mu_iterations > 1:
            plan = plan.with_mu_iterations(
                s.mu_iterations, seed=self.seed * 1_000_003 + self.loop_step
            )
        return plan, ahead

    # -- resume ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Loop counters, the accumulator's window and the probe's verdict (what an exact resume needs)."""
        return {
            "loop_progress": self.loop.progress.state_dict(),
            "accumulator": self.loop.accumulator.state_dict(),
            "old_logprobs": self.ahead.state_dict() if self.ahead is not None else {},
        }

    def load_state_dict(self, state: dict) -> None:
        self.loop.progress.load_state_dict(state["loop_progress"])
        self.loop.accumulator.load_state_dict(state["accumulator"])
        if self.ahead is not None:
            self.ahead.load_state_dict(state["old_logprobs"])
