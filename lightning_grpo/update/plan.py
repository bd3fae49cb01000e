"""The plan of one collected batch: what it needs (``Needs``) and which rows make up chunk ``(mini, micro)``.

``batch_needs`` is the one place that decides what a collected batch needs before training: the ahead pass
(frozen pi_old, the records its hooks and recorders declare), and whether mini-batch 0 may go unrecorded;
``pi_old_source`` beside it decides where pi_old comes from (the sampler, the ahead pass, or the chunk's current
logprobs).

The plan is computed once per collected batch and then only indexed, so the ahead pass
and the training walk see the very same chunks in the very same order. Two ways to cut a
mini-batch into chunks:

* fixed (``rl.micro_batch_per_replica``): contiguous, equal row counts;
* token-budgeted (``rl.max_tokens_per_micro``): the fewest chunks whose padded cost (rows x
  the chunk's longest prompt + completion, what the forward pays once a chunk is trimmed to its
  own longest row) stays under the budget, balanced by cost. A hard cap: only a sequence that
  alone exceeds the budget makes a chunk over it, and it then sits alone (counted in ``oversized``).
  A VLM prompt's image placeholders are already expanded to the image's token count when the
  prompt is built (``vision.py``), so a row's cost counts its visual tokens as sequence tokens.
* token-budgeted and packed (``rl.packed``, ``packing.py``): the same cut, a chunk's cost being its real tokens
  (the sum of its rows' lengths): a packed forward pays no padding.

Chunk counts then depend on the data, so under data parallelism every rank takes, per window,
the max count over ranks (one small all-reduce per collected batch) and runs the missing ones as
*empty* chunks: one row with no counted token, which adds zero to loss and divisor but runs the
same forward/backward collectives (DDP's gradient all-reduce, FSDP2's all-gathers). The deferred
divisor makes any chunking exact. At ``rl.mu_iterations > 1`` the plan holds every epoch's window
order over the same chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from lightning_grpo.batch import RolloutBatch
from lightning_grpo.update.records import ChunkHook

Rows = tuple[int, ...]
EMPTY: Rows = ()
"""The rows of an empty chunk (a DP filler: one masked-out row, zero loss, zero divisor)."""
# Max over data-parallel ranks of an int64 vector (identity on one device).
DPMax = Callable[[Tensor], Tensor]
PiOldSource = Literal["sampler", "ahead", "current"]
"""Where pi_old comes from (``pi_old_source``)."""


@dataclass(frozen=True)
class Needs:
    """What one collected batch needs before its first optimizer step (``batch_needs`` decides it)."""

    pi_old: bool = False
    """Freeze pi_old with the ahead pass: several optimizer steps per batch, a ratio, pi_old not the sampler's."""
    records: bool = False
    """The ahead pass runs for its records even without a pi_old to freeze (a module's ``records.Recorder``, or a
    ``records.ChunkHook`` whose ``HookNeeds.ahead_pass`` asks for it)."""
    every_chunk: bool = False
    """Record every chunk: mini-batch 0 may not be skipped (a recorder's records cover every row; a hook's scope
    reads every chunk's record)."""

    @property
    def ahead_pass(self) -> bool:
        """Whether the ahead pass walks the batch at all."""
        return self.pi_old or self.records

    def skips_first_mini(self, probe_passed: bool, mu_iterations: int) -> bool:
        """Whether mini-batch 0 goes unrecorded. It trains before any update, so its pi_old *is* its current
        logprobs detached; once the probe has shown train- and eval-mode forwards agree, recording it is wasted.
        Not with inner epochs (``rl.mu_iterations > 1`` trains it again after updates, against the rollout policy),
        nor when every chunk's record is needed."""
        return probe_passed and mu_iterations == 1 and not self.every_chunk


def pi_old_source(rl, reads_pi_old: bool = True) -> PiOldSource:
    """The one place that decides where the ratio's pi_old comes from; the ahead pass, the module's chunk and the
    unfrozen-pi_old warning read this answer.

    * ``sampler``: ``rl.rollout_correction.mode=bypass``: the sampler's logprobs, carried by the batch (no ahead pass).
    * ``ahead``: several optimizer steps per batch (n_mini or mu_iterations > 1) with ``rl.freeze_pi_old``, and an
      objective that reads pi_old: the ahead pass records it, frozen, before the first step.
    * ``current``: the chunk's own logprobs, detached: exact when the policy has not moved yet (one step per batch),
      or the diagnostic ``freeze_pi_old=false``, or an objective without a ratio.

    Args:
        rl: the ``rl`` section (``GRPOConfig``).
        reads_pi_old: whether the objective reads pi_old at all (``Objective.needs_old_logprobs``).
    """
    if rl.rollout_correction.mode == "bypass":
        return "sampler"
    several_steps = rl.n_mini > 1 or rl.mu_iterations > 1
    if several_steps and rl.freeze_pi_old and reads_pi_old:
        return "ahead"
    return "current"


def batch_needs(
    rl, objective, hooks: Sequence[ChunkHook] = (), recorders: bool = False
) -> Needs:
    """The one place that decides what a collected batch needs, from the config, the objective and the hooks.

    ``rl``: what ``pi_old_source`` reads and the micro split (``GRPOConfig``); ``hooks``: the per-chunk hooks the
    Updater drives, each declaring its ``HookNeeds``; ``recorders``: whether the module added recorders of its own
    (``GRPOModule.configure_recorders``): they are taken on every chunk, so they always need the ahead pass.
    """
    pi_old = pi_old_source(rl, objective.needs_old_logprobs()) == "ahead"
    declared = [hook.needs(several_chunks(rl)) for hook in hooks]
    ahead = recorders or any(d.ahead_pass for d in declared)
    every_chunk = recorders or any(d.every_chunk for d in declared)
    return Needs(pi_old=pi_old, records=ahead, every_chunk=every_chunk)


def several_chunks(rl) -> bool:
    """Whether a window may take several forward/backward chunks (fixed n_micro > 1, or a token budget)."""
    return rl.n_micro > 1 or bool(rl.max_tokens_per_micro)


class BatchSizeError(ValueError):
    """The collected batch does not have the size the config promises."""


class TokenBudgetError(ValueError):
    """A token budget cannot hold the batch (a prompt alone is longer than it)."""


def _one_rank(t: Tensor) -> Tensor:
    return t


@dataclass(frozen=True)
class ChunkPlan:
    """Row indices of every chunk: ``rows[mini][micro]`` is a tuple of row numbers (``EMPTY``: a DP filler).

    ``order[e]`` is the mini-batch order of epoch ``e`` (``rl.mu_iterations`` epochs over the same chunks;
    one epoch in mini-batch order by default). ``oversized`` counts rows alone in a chunk over the budget.
    """

    rows: tuple[tuple[Rows, ...], ...]
    order: tuple[tuple[int, ...], ...] = ()
    oversized: int = 0

    def __post_init__(self) -> None:
        if not self.order:
            object.__setattr__(self, "order", (tuple(range(len(self.rows))),))

    @classmethod
    def fixed(
        cls, n_rows: int, n_mini: int, n_micro: int, expected_rows: int | None = None
    ) -> ChunkPlan:
        """Contiguous equal chunks; refuses a batch whose size disagrees with the config."""
        check_rows(n_rows, expected_rows)
        if n_rows % (n_mini * n_micro):
            raise BatchSizeError(
                f"collected batch of {n_rows} trajectories does not split into n_mini={n_mini} x n_micro={n_micro} "
                "equal chunks"
            )
        size = n_rows // (n_mini * n_micro)
        return cls(
            tuple(
                tuple(
                    tuple(
                        range(
                            (mi * n_micro + mc) * size, (mi * n_micro + mc + 1) * size
                        )
                    )
                    for mc in range(n_micro)
                )
                for mi in range(n_mini)
            )
        )

    def with_mu_iterations(self, mu_iterations: int, seed: int) -> ChunkPlan:
        """``mu_iterations`` inner epochs over the same chunks: epoch 0 in mini-batch order, each later one in an
        order drawn from ``seed`` (the same on every rank, so the ranks' windows stay aligned)."""
        gen = torch.Generator().manual_seed(seed)
        later = [
            tuple(torch.randperm(self.n_mini, generator=gen).tolist())
            for _ in range(mu_iterations - 1)
        ]
        return replace(self, order=(tuple(range(self.n_mini)), *later))

    # -- shape ---------------------------------------------------------------------------------------------------
    @property
    def n_mini(self) -> int:
        return len(self.rows)

    @property
    def mu_iterations(self) -> int:
        """Inner epochs over the batch (``rl.mu_iterations``)."""
        return len(self.order)

    def n_chunks(self, mini: int) -> int:
        """Chunks (forward/backward calls) of mini-batch ``mini``'s window, empty ones included."""
        return len(self.rows[mini])

    @property
    def real_chunks(self) -> int:
        """Non-empty chunks of one epoch."""
        return sum(r != EMPTY for chunks in self.rows for r in chunks)

    @property
    def empty_chunks(self) -> int:
        """DP fillers of one epoch."""
        return sum(r == EMPTY for chunks in self.rows for r in chunks)

    def windows(self) -> Iterator[tuple[int, int]]:
        """Every ``(epoch, mini)`` in training order: one optimizer step each."""
        for epoch, order in enumerate(self.order):
            for mini in order:
                yield epoch, mini

    def walk(self) -> Iterator[tuple[int, int]]:
        """Every ``(mini, micro)`` of one epoch in mini-batch order (the ahead pass records these)."""
        for mini in range(self.n_mini):
            for micro in range(self.n_chunks(mini)):
                yield mini, micro

    def training_walk(self) -> Iterator[tuple[int, int, int]]:
        """Every ``(epoch, mini, micro)`` in training order (what the loop and pi_old pair by)."""
        for epoch, mini in self.windows():
            for micro in range(self.n_chunks(mini)):
                yield epoch, mini, micro

    def chunk(self, batch: RolloutBatch, mini: int, micro: int) -> RolloutBatch:
        """Materialize exactly chunk ``(mini, micro)`` of ``batch``, trimmed to its longest sequence."""
        return take(batch, self.rows[mini][micro])


def take(batch: RolloutBatch, rows: Rows) -> RolloutBatch:
    """Rows ``rows`` of ``batch`` trimmed to their longest sequence; ``EMPTY``: a one-row, no-token filler."""
    if rows == EMPTY:
        return empty_chunk(batch)
    if len(rows) == rows[-1] - rows[0] + 1:  # contiguous: a view, no gather
        return batch.select(slice(rows[0], rows[-1] + 1))
    return batch.select(torch.tensor(rows, dtype=torch.long))


def empty_chunk(batch: RolloutBatch) -> RolloutBatch:
    """Row 0 cut to 2 tokens with nothing counted: the forward/backward runs (same collectives), adds zero.

    It carries no image references: a filler materializes no pixels (row 0's images would not even match its two
    tokens), so a VLM's filler costs two text tokens like any other."""
    one = batch.select(slice(0, 1))
    cut = {name: getattr(one, name)[:, :2] for name in ("input_ids", "attention_mask")}
    lp = one.rollout_logprobs
    return replace(
        one,
        **cut,
        completion_mask=torch.zeros_like(cut["attention_mask"]),
        advantages=torch.zeros_like(one.advantages),
        rewards=torch.zeros_like(one.rewards),
        rollout_logprobs=None if lp is None else torch.zeros_like(lp[:, :2]),
        images=None,
    )


def plan_update(
    batch: RolloutBatch,
    n_mini: int,
    n_micro: int,
    budget: int = 0,
    ahead_rows: list[int] | None = None,
    ahead_budget: int = 0,
    dp_max: DPMax = _one_rank,
    expected_rows: int | None = None,
    packed: bool = False,
) -> tuple[ChunkPlan, ChunkPlan | None]:
    """The training plan of one collected batch, and the ahead pass's own plan when it has a budget of its own.

    ``budget`` 0: fixed ``n_micro`` chunks per mini-batch. Otherwise each of the ``n_mini`` contiguous mini-batches
    is cut by ``token_chunks``. ``ahead_rows`` (the rows the ahead pass must score) with ``ahead_budget`` > 0 are cut
    the same way into one flat walk; else the ahead pass walks the training chunks. Budgeted counts are the max over
    ranks, the missing chunks ``EMPTY``: one all-reduce for both plans, after which every rank refuses together a
    prompt longer than a budget (nobody is left waiting in a collective). ``packed``: a chunk costs its real tokens.
    """
    check_rows(len(batch), expected_rows)
    if not budget:
        plan = ChunkPlan.fixed(len(batch), n_mini, n_micro)
        groups = []
    else:
        if len(batch) % n_mini:
            raise BatchSizeError(
                f"collected batch of {len(batch)} trajectories does not split into n_mini={n_mini}"
            )
        size = len(batch) // n_mini
        groups = [(range(m * size, (m + 1) * size), budget) for m in range(n_mini)]
    if ahead_rows is not None and ahead_budget:
        groups.append((ahead_rows, ahead_budget))
    if not groups:
        return plan, None
    lengths, prompts = sequence_lengths(batch)
    cut = [token_chunks(lengths, rows, b, packed) for rows, b in groups]
    counts = dp_max(
        torch.tensor(
            [len(c) for c in cut] + [max(prompts, default=0)], dtype=torch.int64
        )
    ).tolist()
    if budget:
        check_prompts(counts[-1], budget, "rl.max_tokens_per_micro")
    if ahead_rows is not None and ahead_budget:
        check_prompts(counts[-1], ahead_budget, "rl.max_tokens_per_ahead_micro")
    padded = [tuple(c) + (EMPTY,) * (n - len(c)) for c, n in zip(cut, counts[:-1])]
    if budget:
        oversized = sum(
            len(c) == 1 and lengths[c[0]] > budget
            for chunks in cut[:n_mini]
            for c in chunks
        )
        plan = ChunkPlan(tuple(padded[:n_mini]), oversized=oversized)
    ahead = (
        ChunkPlan((padded[-1],)) if ahead_rows is not None and ahead_budget else None
    )
    return plan, ahead


def check_rows(n_rows: int, expected_rows: int | None) -> None:
    if expected_rows is not None and n_rows != expected_rows:
        raise BatchSizeError(
            f"collected batch has {n_rows} trajectories on this rank but the config expects {expected_rows} "
            "(rl.batch_per_replica / DP size); check the engine returned group_size completions per prompt"
        )


def check_prompts(longest_prompt: int, budget: int, field: str) -> None:
    if longest_prompt > budget:
        raise TokenBudgetError(
            f"{field}={budget} is smaller than the longest prompt in this collected batch ({longest_prompt} tokens): "
            f"no chunk could hold it with any completion. Raise {field} to at least {longest_prompt} plus the "
            "completion length (rollout.max_new_tokens), or cap prompts with rollout.max_prompt_tokens"
        )


def sequence_lengths(batch: RolloutBatch) -> tuple[list[int], list[int]]:
    """(prompt + completion tokens, prompt tokens) per row: a chunk's forward pays rows x its longest of the first.
    Prompt tokens include a VLM row's expanded image placeholders (``t*h*w / merge**2`` per image)."""
    total = batch.attention_mask.sum(-1)
    return total.tolist(), (total - batch.completion_mask.sum(-1)).tolist()


def token_chunks(
    lengths: list[int], rows, budget: int, packed: bool = False
) -> list[Rows]:
    """The fewest chunks of ``rows`` whose padded cost (rows x longest, at least 2 tokens; ``packed``: the sum of the
    rows' lengths) stays <= ``budget``, balanced: among those, the smallest largest chunk cost. Deterministic.

    Sorting rows by length and cutting the sorted order into runs is what keeps padding small: a chunk pads to its
    own longest row, so rows of similar length belong together. Greedy runs give the fewest chunks; a bisection on
    the cost cap then finds the most balanced cut with that many. A row longer than the budget is a chunk alone.
    """
    # longest first, ties by row: deterministic
    ordered = sorted(rows, key=lambda r: (-lengths[r], r))
    cost = [max(lengths[r], 2) for r in ordered]
    runs = _packed_runs if packed else _runs
    fewest = len(runs(cost, budget))
    lo = 1
    hi = budget  # the smallest cap that still needs no more than `fewest` runs
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(runs(cost, mid)) <= fewest else (mid + 1, hi)
    return [tuple(sorted(ordered[a:b])) for a, b in runs(cost, lo)]


def _runs(cost: list[int], cap: int) -> list[tuple[int, int]]:
    """Greedy runs ``[a, b)`` of a longest-first cost list with (b - a) x cost[a] <= cap (a single row always fits)."""
    runs = []
    a = 0
    while a < len(cost):
        b = a + max(cap // cost[a], 1)
        runs.append((a, min(b, len(cost))))
        a = b
    return runs


def _packed_runs(cost: list[int], cap: int) -> list[tuple[int, int]]:
    """Greedy runs ``[a, b)`` with sum(cost[a:b]) <= cap (a single row always fits): a packed chunk's real tokens."""
    runs = []
    a = 0
    while a < len(cost):
        b = a + 1
        total = cost[a]
        while b < len(cost) and total + cost[b] <= cap:
            total += cost[b]
            b += 1
        runs.append((a, b))
        a = b
    return runs
