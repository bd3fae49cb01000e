"""Preemption: SIGTERM / SIGUSR1 become an emergency checkpoint at the next safe point, then a non-zero exit.

Lightning's own handling (``_SignalConnector``): SIGTERM sets ``trainer.received_sigterm`` and the
loops raise ``SIGTERMException``, a ``SystemExit`` with code 0 and no checkpoint; with SLURM
auto-requeue (``SLURMEnvironment(auto_requeue=True)``) SIGUSR1 saves ``hpc_ckpt_<n>.ckpt`` and
requeues the job *inside the signal handler*, wherever the step happens to be. Lightning installs
its handlers right before the fit loop runs and puts the previous ones back when fit ends.

``SignalWatch`` cooperates with that: at ``on_train_start`` it wraps whatever handler is installed
for SIGTERM and SIGUSR1 (Lightning's) with one that only records the signal. At the next safe
point (the end of a loop step, or of a validation batch) every rank agrees on it (one tiny
all-reduce per loop step under DP), the checkpoint callback saves, and then the wrapped handler runs
there, on every rank alike: Lightning's SIGTERM notifier (its flag, its forward to launched
processes), or its SLURM requeue, whose ``hpc_ckpt`` then also holds a batch boundary. The run then
exits with ``128 + signal number`` (143 for SIGTERM, 138 for SIGUSR1) through ``Preempted``.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

import torch
from lightning.pytorch import Trainer

WATCHED = (signal.SIGTERM, signal.SIGUSR1)
# what the installed watch recorded (one fit per process)
_RECEIVED: dict[str, int | None] = {"signum": None}


def requested_signal() -> int | None:
    """The watched signal received during this fit and not yet acted on, or None (polled by long waits)."""
    return _RECEIVED["signum"]


class Preempted(SystemExit):
    """The run stopped on a signal after an emergency checkpoint; exits with ``128 + signum``."""

    def __init__(self, signum: int, path: object, loop_step: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.path = path
        self.loop_step = loop_step

    def __str__(self) -> str:
        return (
            f"stopped by {signal.Signals(self.signum).name} after loop step {self.loop_step}: emergency "
            f"checkpoint {self.path}; resume with --ckpt_path last (exit code {self.code})"
        )


class StopRequested(SystemExit):
    """A watched signal arrived while the run waited on a call (a reward function): the wait is given up.

    ``GRPOCheckpoint`` saves the batch boundary on the way out (the update has not started); exits ``128 + signum``.
    """

    def __init__(self, signum: int, waiting_on: str) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.waiting_on = waiting_on

    def __str__(self) -> str:
        return f"{signal.Signals(self.signum).name} arrived while waiting on {self.waiting_on}: stopping"


def stop_poll(trainer: Trainer | None, waiting_on: str) -> Callable[[], bool] | None:
    """``should_stop`` for a long wait: a watched signal raises ``StopRequested`` (``GRPOCheckpoint`` then saves the
    boundary on the way out); without a watch (no ``GRPOCheckpoint``), Lightning's SIGTERM flag ends the wait. None
    without a Trainer (a module driven by hand): nothing to poll, the wait runs to its end."""
    if trainer is None:
        return None

    def poll() -> bool:
        if (signum := requested_signal()) is not None:
            raise StopRequested(signum, waiting_on)
        return bool(getattr(trainer, "received_sigterm", False))

    return poll


class SignalWatch:
    """Records SIGTERM / SIGUSR1 while a fit trains; the checkpoint callback acts on them at safe points."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._wrapped: dict[int, object] = {}

    @property
    def active(self) -> bool:
        """Whether our handlers are installed (from ``on_train_start`` until fit ends)."""
        return bool(self._wrapped)

    def install(self, trainer: Trainer) -> None:
        """Wrap the installed handlers (Lightning's, from just before the fit loop); main thread only."""
        if threading.current_thread() is not threading.main_thread() or self._wrapped:
            return
        # before we looked
        self.received = (
            signal.SIGTERM if getattr(trainer, "received_sigterm", False) else None
        )
        _RECEIVED["signum"] = self.received
        for signum in WATCHED:
            self._wrapped[signum] = signal.getsignal(signum)
            signal.signal(signum, self._record)

    def restore(self) -> None:
        """Put the wrapped handlers back (before Lightning restores its own originals at teardown)."""
        for signum, handler in self._wrapped.items():
            if signal.getsignal(signum) == self._record:
                signal.signal(
                    signum, handler if handler is not None else signal.SIG_DFL
                )
        self._wrapped = {}
        _RECEIVED["signum"] = None

    def _record(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: a signal handler runs between two bytecodes of whatever the main thread is doing.
        if self.received is None:
            self.received = _RECEIVED["signum"] = signum

    def pending(self, trainer: Trainer) -> int | None:
        """The signal every rank acts on at this safe point (a collective under DP: all ranks call it), or None."""
        mine = self.received or 0
        if trainer.world_size > 1:
            flag = torch.tensor(float(mine), device=trainer.strategy.root_device)
            mine = int(trainer.strategy.reduce(flag, reduce_op="max"))
        return mine or None

    def forward(self, signum: int) -> None:
        """Run the handler we wrapped for ``signum`` now, at the safe point (Lightning's SIGTERM or SLURM requeue)."""
        handler = self._wrapped.get(signum)
        if callable(handler):
            handler(signum, None)
