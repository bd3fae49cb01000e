"""The objective protocol: what the loop calls per chunk, and what an objective may ask of the policy.

An objective turns one chunk into ``(loss, denom, stats)``: ``loss`` is the chunk's own normalized
loss, ``denom`` the divisor it used (a DP mean: masked tokens for a token mean, pairs for DPO), so the
accumulator backprops ``loss * denom`` and divides once at the step. ``stats`` is a frozen dataclass of
0-d tensors whose ``REDUCE`` table tells the roll-up how each field becomes one figure per collected
batch. ``needs_old_logprobs()`` says whether the loss consumes pi_old (a ratio); only then does
mini-batching pay for the ahead pass. The loop, accumulator, countdown, roll-up and hand-off never
see which objective runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from torch import Tensor, nn

from lightning_grpo.batch import RolloutBatch

Reduction = tuple[str, str]
"""``(metric name, how)``: how is ``"sum"``, ``"max"``, or the name of the field that weighs a mean."""


class Stats(Protocol):
    """What one chunk reports: 0-d tensors, and how each rolls up (``metrics.roll_up``)."""

    REDUCE: ClassVar[dict[str, Reduction]]
    loss: Tensor
    denom: Tensor


@dataclass(frozen=True)
class PolicyView:
    """What an objective may ask of the trained policy for one chunk (the module builds it once).

    Attributes:
        model: the policy (an FSDP2-sharded one too: run decoder/head code through ``call``).
        temperature: the sampling temperature; policy logprobs are scored at it.
        logprobs: ``chunk -> [B, T-1]`` per-token logprobs of the policy, with grad (the module's scorer).
        reference: ``chunk -> [B, T-1]`` logprobs of the frozen initial policy, no grad; None when the module
            built no reference (``rl.beta == 0``).
        call: ``call(fn, *args)`` runs ``fn(*args)`` as a forward of ``model`` (FSDP2 gathers its root around it).
        logprobs_and_entropy: ``(chunk, grad) -> ([B, T-1] logprobs, [B, T-1] entropy)`` from one head pass: the
            logprobs exactly as ``logprobs`` gives them, the entropy of the policy at the same positions and
            temperature, with grad only when ``grad`` (an entropy bonus). None: the view cannot measure entropy.
    """

    model: nn.Module
    temperature: float
    logprobs: Callable[[RolloutBatch], Tensor]
    reference: Callable[[RolloutBatch], Tensor] | None
    call: Callable[..., Any]
    logprobs_and_entropy: (
        Callable[[RolloutBatch, bool], tuple[Tensor, Tensor]] | None
    ) = None


@runtime_checkable
class Objective(Protocol):
    """A loss over rollout chunks, picked by ``model.objective`` from the registry (``objectives/__init__.py``)."""

    name: ClassVar[str]
    stats: ClassVar[type]
    """The stats class ``chunk_loss`` returns (its ``REDUCE`` table names the logged figures)."""

    def needs_old_logprobs(self) -> bool:
        """True when the loss consumes pi_old (a ratio): mini-batching then freezes it with the ahead pass."""
        ...

    def needs_reference(self) -> bool:
        """True when ``PolicyView.reference`` must exist (the module then builds the frozen initial policy)."""
        ...

    def setup(self, policy: nn.Module, tokenizer) -> None:
        """Called once the policy exists (``configure_model``): build teachers, refuse mismatches."""
        ...

    def chunk_loss(
        self, chunk: RolloutBatch, policy: PolicyView, old_logprobs: Tensor | None
    ) -> tuple[Tensor, Tensor, Stats]:
        """``(loss, denom, stats)`` of one chunk (on the policy's device); ``old_logprobs`` is pi_old or None."""
        ...


@runtime_checkable
class ExplainsTokens(Protocol):
    """An objective whose per-token figure is what it optimizes, shown beside each completion in the completions log
    (OPD: the KL to the teacher; GRPO's is the advantage, already in the rows)."""

    token_figure: ClassVar[str]
    """The figure's name in ``completions.jsonl`` (e.g. ``kl_to_teacher``)."""

    def token_figures(self, chunk: RolloutBatch, policy: PolicyView) -> Tensor:
        """``[B, T-1]`` the figure at each completion position of ``chunk`` (no gradient)."""
        ...

    def uses_advantages(self) -> bool:
        """Whether the loss reads the rows' advantages (False: the log shows none, it would mean nothing)."""
        ...


def nonzero(denom: Tensor) -> Tensor:
    """``denom`` with 0 replaced by 1: an all-masked chunk has loss 0, never 0/0. Only 0 is guarded: a DP-mean divisor
    may lie in (0, 1), and clamping it would make ``loss * denom`` differ from the chunk's sum."""
    return denom.where(denom > 0, denom.new_ones(()))
