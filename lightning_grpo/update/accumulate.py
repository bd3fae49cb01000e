"""Deferred-divisor gradient accumulation with the poisoned-window countdown.

One optimizer step consumes ``grad_accum`` (= ``n_micro``) ``train`` calls, its *window*. A token-budgeted
plan sets each window's count before it opens (``open_window``).

* ``grad_accum == 1``: backprop the chunk's normalized loss as is. This is the unchunked
  expression, kept on purpose: ``(sum a_i) * s`` and ``sum (a_i * s)`` differ in the last bits.
* ``grad_accum > 1``: backprop each chunk's un-normalized sum (``loss * denom``), add up the
  divisors, and at the step scale the gradient once by ``1 / sum denom``. Gradients are linear,
  so this equals the unchunked token mean. Only ``sum == 0`` is guarded (an all-empty window keeps
  its zero gradient instead of 0/0): under DP the divisor is a mean and may lie in (0, 1).
  The sum is carried divided by a window constant ``ref`` (the power of two just above the first
  chunk's divisor x ``n_micro``, close to ``sum denom``) and the step scales by ``ref / sum denom``:
  the same update, but the backward keeps the token mean's magnitude instead of ``denom`` times it,
  which would overflow fp16 gradients (16-mixed, 16-true) on long chunks. A power of two scales
  without rounding, so every other precision rounds exactly as with the plain sum.
* The step's order is fixed: unscale (a GradScaler, fp16) -> x 1/sum -> norm -> clip -> step.
  Clipping before the scale (or before unscaling) clips at the wrong scale and silently changes
  the update. The step *driver* owns the first and last stage (see ``plain_step`` and
  ``precision.PluginStep``, which goes through Lightning's precision plugin).
* A non-finite chunk loss poisons its whole window: grads are zeroed, the divisor resets, and
  the remaining calls of that window are discarded, so the optimizer never steps on a mixture
  of two mini-batches. A non-finite gradient norm at the step skips that step (a GradScaler
  still sees it: it skips the update itself and lowers its scale).
* ``consecutive_skips`` counts windows skipped in a row (a step taken resets it): the loop stops a
  run past ``rl.max_consecutive_skips``, since ``global_step`` counts only the steps taken.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

GradSync = Callable[[bool], contextlib.AbstractContextManager]
# finish() normalizes and clips the window's gradients and returns their norm; a driver runs the optimizer step so that
# finish() sees gradients at their true scale (after a GradScaler's unscale_) before the parameters change, and returns
# that norm. A non-finite norm means the step was skipped.
StepDriver = Callable[[Callable[[], float]], float]
# clip(max_norm, total_norm) scales the gradients down to max_norm; only called when total_norm > max_norm.
Clip = Callable[[float, Tensor], None]


def plain_step(optimizer) -> StepDriver:
    """The driver for gradients already at their true scale (no GradScaler): finish, then step unless non-finite."""

    def drive(finish: Callable[[], float]) -> float:
        norm = finish()
        if math.isfinite(norm):
            optimizer.step()
        return norm

    return drive


def plain_backward(loss: Tensor) -> None:
    """The backward of one chunk without a precision plugin (a Trainer's goes through ``manual_backward``)."""
    loss.backward()


def _no_sync_control(enabled: bool) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _local_finite(loss: Tensor) -> bool:
    return bool(torch.isfinite(loss))


@dataclass(frozen=True)
class StepOutcome:
    """What one closed window did."""

    grad_norm: float
    """Global gradient norm after normalization, before clipping (nan when skipped)."""
    lr: float
    skipped: bool
    cause: str | None = None
    """Why a skipped window was skipped: ``"loss"`` (a non-finite chunk loss) or ``"gradient"`` (a non-finite norm)."""


class DeferredAccumulator:
    """Accumulates ``grad_accum`` chunks per optimizer step with a deferred divisor.

    Args:
        params: the parameters the optimizer updates.
        optimizer: anything with ``step()`` / ``zero_grad()`` (a Lightning optimizer is fine).
        grad_accum: train calls per optimizer step (``n_micro``).
        max_grad_norm: clip threshold after normalization; 0 = measure the norm, never clip.
        backward: how to backprop a loss (``LightningModule.manual_backward`` under a Trainer).
        scheduler: LR scheduler stepped once per optimizer step (Lightning never steps it under
            manual optimization).
        grad_sync: ``grad_sync(enabled)`` context; non-final calls run with sync disabled (DDP
            ``no_sync`` / FSDP2 ``set_requires_gradient_sync``).
        all_finite: ``all_finite(loss)`` -> whether the chunk loss is finite on *every* data-parallel
            rank. The poison decision must be collective: a rank that abandons its window while another
            goes on to the synced backward leaves that one waiting in the all-reduce.
        step: runs the optimizer step around ``finish`` (``plain_step(optimizer)`` by default; under a
            Trainer, ``precision.PluginStep`` through the precision plugin, which unscales fp16 first).
        clip: ``clip(max_norm, total_norm)``; default ``torch.nn.utils.clip_grads_with_norm_`` (under a
            Trainer: ``LightningModule.clip_gradients``, the precision plugin's clipping).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        optimizer,
        grad_accum: int,
        max_grad_norm: float = 0.0,
        backward: Callable[[Tensor], None] | None = None,
        scheduler=None,
        grad_sync: GradSync | None = None,
        all_finite: Callable[[Tensor], bool] | None = None,
        step: StepDriver | None = None,
        clip: Clip | None = None,
    ) -> None:
        if grad_accum < 1:
            raise ValueError(
                f"DeferredAccumulator(grad_accum={grad_accum}): must be >= 1"
            )
        self.params = [p for p in params if p.requires_grad]
        self.optimizer = optimizer
        self.grad_accum = grad_accum
        self.max_grad_norm = max_grad_norm
        self.backward = backward or plain_backward
        self.scheduler = scheduler
        # None: one process, nothing to skip
        self.grad_sync = grad_sync or _no_sync_control
        self.all_finite = all_finite or _local_finite
        self.step = step or plain_step(optimizer)
        self.clip = clip or functools.partial(
            torch.nn.utils.clip_grads_with_norm_, self.params
        )
        self._calls = 0  # calls taken into the current window
        self._denom_sum: Tensor | float = 0.0
        # window constant the chunk sums are carried divided by
        self._ref: Tensor | float = 1.0
        self._discard = 0  # countdown: calls of a poisoned window still to drop
        self.skipped_steps = 0
        self.discarded_chunks = 0
        self.consecutive_skips = 0  # windows skipped since the last step taken
        # "loss" or "gradient": why the last window was skipped
        self.last_skip_cause: str | None = None

    # -- the countdown -----------------------------------------------------------------------------------------
    def discarding(self) -> bool:
        """True while the next call belongs to a poisoned window (skip its forward, call ``discard``)."""
        return self._discard > 0

    def discard(self) -> StepOutcome | None:
        """Drop one call of a poisoned window; returns the skipped step's outcome when the window ends."""
        self._discard -= 1
        self.discarded_chunks += 1
        return self._skipped() if self._discard == 0 else None

    def _skipped(self) -> StepOutcome:
        return StepOutcome(
            grad_norm=math.nan, lr=self._lr(), skipped=True, cause="loss"
        )

    def _poison(self) -> None:
        self._discard = self.grad_accum - 1 - self._calls
        self.discarded_chunks += 1  # the non-finite chunk itself
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self.last_skip_cause = "loss"
        self._reset_window()

    def _reset_window(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._calls = 0
        self._denom_sum = 0.0
        self._ref = 1.0

    def open_window(self, n_chunks: int) -> None:
        """The next window takes ``n_chunks`` calls (a token-budgeted plan's count is data-dependent).

        Only between windows: the countdown of a poisoned window counts the calls of *that* window, so it discards
        exactly its rest and the next window starts clean at the count given here.
        """
        if n_chunks < 1:
            raise ValueError(
                f"open_window(n_chunks={n_chunks}): a window takes at least one call"
            )
        if self._calls or self._discard:
            raise RuntimeError(
                f"open_window({n_chunks}) inside a window ({self._calls} calls taken, "
                f"{self._discard} to discard): windows change length only at a boundary"
            )
        self.grad_accum = n_chunks

    # -- one call ----------------------------------------------------------------------------------------------
    @property
    def closes_window(self) -> bool:
        """Whether the next call is the last of its window (the one that steps)."""
        return self._calls == self.grad_accum - 1

    def train(self, loss: Tensor, denom: Tensor) -> StepOutcome | None:
        """Backprop one chunk; on the window's last call, step. Returns the step's outcome then."""
        if self.discarding():
            raise RuntimeError(
                "train() called during a poisoned window; check discarding() first"
            )
        # CPU-GPU sync point (a collective under DP), once per chunk
        if not self.all_finite(loss.detach()):
            self._poison()
            return self._skipped() if self._discard == 0 else None
        last = self.closes_window
        with self.grad_sync(last):
            self.backward(
                loss if self.grad_accum == 1 else loss * self._carry(denom.detach())
            )
        self._denom_sum = self._denom_sum + denom.detach()
        self._calls += 1
        return self._step() if last else None

    def _carry(self, denom: Tensor) -> Tensor:
        """``denom / ref``: the factor that turns a chunk's token mean into its sum, divided by ``ref``."""
        if self._calls == 0:
            _, exponent = torch.frexp(
                torch.where(denom > 0, denom * self.grad_accum, torch.ones_like(denom))
            )
            # 2^e, just above first divisor x n_micro
            self._ref = torch.ldexp(torch.ones_like(denom), exponent)
        return denom / self._ref

    def _step(self) -> StepOutcome:
        lr = self._lr()
        grad_norm = self.step(self._finish)
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            self.last_skip_cause = "gradient"
        else:
            self.consecutive_skips = 0
            if self.scheduler is not None:
                self.scheduler.step()
        self._reset_window()
        return StepOutcome(
            grad_norm=grad_norm,
            lr=lr,
            skipped=skipped,
            cause="gradient" if skipped else None,
        )

    def _finish(self) -> float:
        """Gradients at their true scale -> x ref / sum denom -> norm -> clip. Returns the norm (before clipping)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        if self.grad_accum > 1:
            total = torch.as_tensor(self._denom_sum, dtype=torch.float64)
            ref = torch.as_tensor(self._ref, dtype=torch.float64, device=total.device)
            # guard sum == 0 only
            scale = torch.where(total > 0, ref / total, torch.ones_like(total))
            torch._foreach_mul_(grads, scale.to(grads[0].device, grads[0].dtype))
        norm = torch.nn.utils.get_total_norm(grads)
        # FSDP2: a DTensor
        total_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if (
            self.max_grad_norm
            and math.isfinite(total_norm)
            and total_norm > self.max_grad_norm
        ):
            self.clip(self.max_grad_norm, norm)
        return total_norm

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # -- resume ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "window": self.grad_accum,
            "calls": self._calls,
            "denom_sum": float(self._denom_sum),
            "ref": float(self._ref),
            "discard": self._discard,
            "skipped_steps": self.skipped_steps,
            "discarded_chunks": self.discarded_chunks,
            "consecutive_skips": self.consecutive_skips,
        }

    def load_state_dict(self, state: dict) -> None:
        self._calls = state["calls"]
        self._denom_sum = state["denom_sum"]
        self._discard = state["discard"]
        self._ref = state.get("ref", 1.0)
        self.grad_accum = state.get("window", self.grad_accum)
        self.skipped_steps = state["skipped_steps"]
        self.discarded_chunks = state["discarded_chunks"]
        # absent in checkpoints before 0.x
        self.consecutive_skips = state.get("consecutive_skips", 0)
