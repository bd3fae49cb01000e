"""Async rollouts with bounded staleness (``rollout.max_off_policy_steps``): the next loop steps' rollouts are drawn
while this one's update runs.

``AsyncRollouts`` wraps an engine that holds weights of its own in another process (``vllm serve``): the update
runs in the trainer while the server samples. Which weights each batch is drawn with is fixed by the schedule,
never by timing, so an async run is reproducible:

* a weight sync (``load_weights`` .. ``reset_prefix_cache``, from the hand-off at a batch boundary) first waits
  until nothing is in flight, so every batch is drawn with exactly one weight version;
* after loop step ``s`` takes its batch, the batches of steps ``s+1 .. s+k`` that are not in flight yet are
  submitted with the weights the engine holds then (those of loop step ``s-1``), in order, on one worker thread.

So with ``k = 1`` the batch of step ``s+1`` is sampled while step ``s`` updates (verl's one-step-off), and every
batch is exactly one loop step stale; ``k = 0`` never wraps the engine (the synchronous order). With one server a
deeper ``k`` bounds the staleness the same way but overlaps no more than ``k = 1``: the sync at each boundary waits
for everything in flight. A draw whose prompts or seed differ from what was submitted (a resume, a refill round,
validation) is drawn on the spot, after the in-flight batches, with the current weights.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from lightning_grpo.rollout.base import (
    Closable,
    DeclaresWeights,
    LoadsAdapters,
    Prompt,
    RestartsServers,
    Rollout,
    RolloutEngine,
    SamplingConfig,
    Served,
    UpdatesInFlight,
    WeightDevice,
    WeightDtype,
)

Job = Callable[
    [Sequence[Prompt], SamplingConfig], tuple[list[Rollout], dict[str, float]]
]
"""Draws one batch with the wrapped engine: (prompts, sampling) -> (rollouts, episode metrics)."""


@dataclass
class InFlight:
    """One submitted batch: what it was drawn from and with, and (once done) its result or error."""

    step: int
    prompt_ids: list[int]
    seed: int | None
    weights_step: int
    """Loop step whose weights the engine held when the batch was submitted."""
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[list[Rollout], dict[str, float]] | None = None
    error: BaseException | None = None

    def wait(
        self, should_stop: Callable[[], bool] | None
    ) -> tuple[list[Rollout], dict[str, float]]:
        _settle(self, should_stop)
        if self.error is not None:
            raise self.error
        return self.result


class AsyncRollouts:
    """An engine whose training draws run ahead of the update by up to ``max_off_policy_steps`` loop steps.

    It implements the engine protocol and, by delegating to the wrapped engine, the capabilities the hand-off and
    the weight sync use (``rollout/base.py``): ``Closable``, ``HoldsWeights``, ``WeightDtype``, ``WeightDevice``,
    ``DeclaresWeights``, ``LoadsAdapters`` and ``DrawsAhead``. Anything else is the wrapped engine's:
    ``unwrapped(engine)``.

    Args:
        engine: the wrapped engine (its weights live elsewhere: ``VLLMServerEngine``).
        max_off_policy_steps: k >= 1, batches drawn ahead (each at most k loop steps stale when trained on).
        weights_step: the loop step whose weights the trainer holds now (read when a sync ends).
    """

    holds_weights = True

    def __init__(
        self,
        engine: RolloutEngine,
        max_off_policy_steps: int,
        weights_step: Callable[[], int],
    ) -> None:
        if max_off_policy_steps < 1:
            raise ValueError(
                f"AsyncRollouts(max_off_policy_steps={max_off_policy_steps}): must be >= 1 (0 = do "
                "not wrap the engine)"
            )
        self.engine = engine
        self.k = max_off_policy_steps
        self._weights_now = weights_step
        self.max_off_policy_steps = max_off_policy_steps
        self.weights_step = weights_step()
        """Loop step whose weights the engine holds (set when a sync ends)."""
        self.inflight = isinstance(engine, UpdatesInFlight) and engine.updates_in_flight
        """``rollout.server.inflight_updates``: a sync cuts the batches in flight instead of waiting for them, and puts
        the next batch the schedule allows in flight at once (``_after_sync``)."""
        self._step_of = {engine.version: self.weights_step} if self.inflight else {}
        """The engine's weight version -> the loop step whose weights it is (per-token versions are translated)."""
        self._early: tuple[int, tuple[Sequence[Prompt], SamplingConfig], Job] | None = (
            None
        )
        """(step, its prompts and sampling, job) of the batch the next sync puts in flight (``_after_sync``): read when
        the last ``submit_ahead`` ran, while the data position is the one its ``batches`` counts from."""
        self._flight: dict[int, InFlight] = {}
        self._queue: list[tuple[InFlight, Callable[[], tuple]]] = []
        self._wake = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(
            target=self._work, name="lightning-grpo-rollouts", daemon=True
        )
        # the worker never republishes: the training thread does, in take
        if isinstance(engine, RestartsServers):
            engine.hold_restarts(self._worker)
        self._worker.start()

    # -- the training draw -----------------------------------------------------------------------------------------
    def take(
        self,
        step: int,
        prompts: Sequence[Prompt],
        sampling: SamplingConfig,
        job: Job,
        should_stop: Callable[[], bool] | None = None,
    ) -> tuple[list[Rollout], dict[str, float], int]:
        """Loop step ``step``'s batch: the one in flight if it was drawn from these prompts and seed, else drawn
        now. Returns (rollouts, episode metrics, loop step of the weights it was drawn with)."""
        # never taken (a step drawn afresh): drop it
        for old in [s for s in self._flight if s < step]:
            _settle(self._flight.pop(old), should_stop)
        flight = self._flight.pop(step, None)
        if flight is not None and (
            flight.prompt_ids != [p.id for p in prompts] or flight.seed != sampling.seed
        ):
            # not ours (the data or the seed changed): wait it out, draw afresh
            _settle(flight, should_stop)
            flight = None
        if flight is None:
            flight = self._draw_now(step, prompts, sampling, job, should_stop)
        while True:
            try:
                rollouts, metrics = flight.wait(should_stop)
                return self._in_steps(rollouts), metrics, flight.weights_step
            except Exception as err:
                if not self._recovered(err, should_stop):
                    # not a death a restart repairs, or none left: the stop message
                    raise
                # same prompts and seeds
                flight = self._draw_now(step, prompts, sampling, job, should_stop)

    def _draw_now(
        self,
        step: int,
        prompts: Sequence[Prompt],
        sampling: SamplingConfig,
        job: Job,
        should_stop: Callable[[], bool] | None,
    ) -> InFlight:
        """Draw step ``step``'s batch now, after everything in flight, with the weights the engine holds."""
        self.wait_idle(should_stop)
        flight = self._submit(step, prompts, sampling, job)
        del self._flight[step]  # drawn now: taken, not in flight
        return flight

    def _recovered(
        self, err: BaseException, should_stop: Callable[[], bool] | None = None
    ) -> bool:
        """A draw met a dead server: with the worker idle, the engine starts it again and republishes the trainer's
        weights (``rollout/server/restarts.py``); the batches drawn from now on hold those weights."""
        if not isinstance(self.engine, RestartsServers):
            return False
        # in-flight draws that met the same death end (with its error) first
        self.wait_idle(should_stop)
        if not self.engine.recover(err):
            return False
        # the trainer's current weights, republished
        self.weights_step = self._weights_now()
        return True

    def submit_ahead(
        self,
        step: int,
        batches: Callable[[int], tuple[Sequence[Prompt], SamplingConfig] | None],
        job: Job,
    ) -> None:
        """Put the batches of steps ``step+1 .. step+k`` in flight (``batches(i)``: step ``step+i``'s prompts and
        sampling, None when unknown, e.g. past the end of the data)."""
        if self.inflight:
            early = batches(self.k + 1)
            self._early = None if early is None else (step + self.k + 1, early, job)
        for i in range(1, self.k + 1):
            if step + i in self._flight:
                continue
            batch = batches(i)
            if batch is None:
                return
            self._submit(step + i, *batch, job)

    def in_flight(self) -> dict[int, list[int]]:
        """Loop step -> prompt ids of every batch in flight (recorded in checkpoints)."""
        return {step: list(f.prompt_ids) for step, f in sorted(self._flight.items())}

    def wait_idle(self, should_stop: Callable[[], bool] | None = None) -> None:
        """Block until nothing is in flight (a batch's error is raised when it is taken, not here)."""
        for flight in list(self._flight.values()):
            _settle(flight, should_stop)

    # -- the engine protocol: everything else waits for the in-flight batches first -----------------------------
    def generate(
        self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingConfig
    ) -> list[Rollout]:
        self.wait_idle()
        # this thread restarts a dead server itself
        return self.engine.generate(prompts, group_size, sampling)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        if not self.inflight:
            self.wait_idle()  # a batch is drawn with one weight version, never a mix
        self.engine.load_weights(named_tensors)

    def reset_prefix_cache(self) -> None:
        if not self.inflight:
            self.wait_idle()
        self.engine.reset_prefix_cache()
        self.weights_step = self._weights_now()
        if self.inflight:
            self._after_sync()

    def _after_sync(self) -> None:
        """In-flight updates: remember which loop step the new engine version is, and put in flight the batch one step
        further than the last ``submit_ahead`` did: with these weights it is exactly ``k`` steps stale when taken, as
        the schedule allows, and it samples beside the tail of the batches cut by the sync."""
        self._step_of[self.engine.version] = self.weights_step
        if self._early is None or self._early[0] in self._flight:
            return
        step, batch, job = self._early
        self._early = None
        self._submit(step, *batch, job)

    def _in_steps(self, rollouts: list[Rollout]) -> list[Rollout]:
        """Per-token weight versions as loop steps (the engine counts syncs; the stamps count loop steps)."""
        return [
            r
            if r.versions is None
            else replace(r, versions=[self._step_of[v] for v in r.versions])
            for r in rollouts
        ]

    def sleep(self, level: int = 1) -> None:
        self.wait_idle()
        self.engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.engine.wake_up(tags)

    # -- the capabilities of the wrapped engine ----------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype | None:
        return self.engine.dtype if isinstance(self.engine, WeightDtype) else None

    @property
    def device(self) -> torch.device | None:
        return self.engine.device if isinstance(self.engine, WeightDevice) else None

    def weight_names(self) -> list[str]:
        return (
            self.engine.weight_names()
            if isinstance(self.engine, DeclaresWeights)
            else []
        )

    @property
    def serves_adapters(self) -> bool:
        return isinstance(self.engine, LoadsAdapters) and self.engine.serves_adapters

    def load_adapter(self, tensors: dict[str, Tensor], config_json: str) -> None:
        if not isinstance(self.engine, LoadsAdapters):
            raise TypeError(
                f"AsyncRollouts.load_adapter(): the wrapped {type(self.engine).__name__} takes no adapters"
            )
        self.wait_idle()  # no batch samples while the adapter it names is swapped
        self.engine.load_adapter(tensors, config_json)

    def close(self) -> None:
        """Stop the worker; a server at a URL (left running) first finishes what is in flight, so no request of
        this run reaches it later."""
        if not (isinstance(self.engine, Served) and self.engine.server is not None):
            deadline = time.monotonic() + 60.0
            for flight in list(self._flight.values()):
                flight.done.wait(max(0.0, deadline - time.monotonic()))
        with self._wake:
            self._closed = True
            self._wake.notify()
        if isinstance(self.engine, Closable):
            # a launched server stops: a request still in flight fails; the worker is a daemon
            self.engine.close()

    # -- the worker --------------------------------------------------------------------------------------------
    def _submit(
        self, step: int, prompts: Sequence[Prompt], sampling: SamplingConfig, job: Job
    ) -> InFlight:
        flight = InFlight(
            step, [p.id for p in prompts], sampling.seed, self.weights_step
        )
        self._flight[step] = flight
        # batches overlap: the next one samples beside the tail of the one a sync cut
        if self.inflight:
            threading.Thread(
                target=_run,
                args=(flight, functools.partial(job, prompts, sampling)),
                name=f"lightning-grpo-rollouts-{step}",
                daemon=True,
            ).start()
            return flight
        with self._wake:
            self._queue.append((flight, functools.partial(job, prompts, sampling)))
            self._wake.notify()
        return flight

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                flight, run = self._queue.pop(0)
            _run(flight, run)


def _run(flight: InFlight, run: Callable[[], tuple]) -> None:
    """Draw ``flight``'s batch; its result or error waits in it until the batch is taken."""
    try:
        flight.result = run()
    # noqa: BLE001 - handed to the main thread when the batch is taken
    except BaseException as err:
        flight.error = err
    flight.done.set()


def unwrapped(engine: RolloutEngine) -> RolloutEngine:
    """The engine that samples: the wrapped one under ``AsyncRollouts``, else ``engine`` itself."""
    return engine.engine if isinstance(engine, AsyncRollouts) else engine


def _settle(flight: InFlight, should_stop: Callable[[], bool] | None) -> None:
    """Wait until ``flight`` is done (result or error), polled so a SIGTERM ends the wait (``checkpoint/signals.py``)."""
    while not flight.done.wait(0.2):
        if should_stop is not None:
            should_stop()
