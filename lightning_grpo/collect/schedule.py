"""The collector's side of async rollouts (``rollout.max_off_policy_steps``; the engine side is
``AsyncRollouts``).

* ``AsyncSchedule.draw``: loop step ``s``'s batch (in flight, or drawn now), then steps ``s+1 .. s+k`` put in flight
  from the data stream's next prompts with their own seeds; says which weights drew the batch (its version stamp).
* ``record`` / ``in_flight_of``: a checkpoint records the prompts in flight; the resumed run draws them again (same
  prompts, same seeds: the data position did not pass them), so no prompt is lost or trained twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from lightning_grpo.collect.async_rollouts import AsyncRollouts, Job
from lightning_grpo.rollout.base import Prompt, Rollout, RolloutEngine, SamplingConfig

log = logging.getLogger(__name__)

KEY = "async_rollouts"
"""Checkpoint key: ``{"in_flight": {loop step: [prompt ids]}}``."""

Upcoming = Callable[[int], tuple[list[Prompt], SamplingConfig] | None]
"""``i -> (prompts, sampling)`` of the loop step ``i`` steps after the one drawn now (None: not known yet)."""


def draws_ahead(
    engine: RolloutEngine, max_off_policy_steps: int, weights_step: Callable[[], int]
) -> RolloutEngine:
    """``engine`` drawing up to ``rollout.max_off_policy_steps`` loop steps ahead (0: ``engine`` as it is).

    ``weights_step()``: the loop step whose weights the trainer holds (read when a weight sync ends).
    """
    if not max_off_policy_steps:
        return engine
    return AsyncRollouts(engine, max_off_policy_steps, weights_step=weights_step)


def schedule_of(
    engine: RolloutEngine,
    should_stop: Callable[[], bool] | None,
    reissue: dict[int, list[int]],
) -> AsyncSchedule | None:
    """The training draws' schedule of an engine that draws ahead (None: each batch is drawn when asked)."""
    if not isinstance(engine, AsyncRollouts):
        return None
    return AsyncSchedule(engine, should_stop, reissue=reissue)


class AsyncSchedule:
    """Training draws through ``AsyncRollouts``: this step's batch taken, the next ``k`` put in flight.

    Args:
        rollouts: the async engine.
        should_stop: polled while a batch is awaited (a SIGTERM ends the wait), or None.
        reissue: loop step -> prompt ids a loaded checkpoint had in flight (``in_flight_of``); checked when drawn.
    """

    def __init__(
        self,
        rollouts: AsyncRollouts,
        should_stop: Callable[[], bool] | None = None,
        reissue: dict[int, list[int]] | None = None,
    ) -> None:
        self.rollouts = rollouts
        self.should_stop = should_stop
        self._reissue = dict(reissue or {})

    def draw(
        self,
        step: int,
        prompts: Sequence[Prompt],
        sampling: SamplingConfig,
        job: Job,
        upcoming: Upcoming,
    ) -> tuple[list[Rollout], dict[str, float], int]:
        """Loop step ``step``'s batch (``job(prompts, sampling)`` draws one with the wrapped engine), the next k in
        flight (``upcoming(i)``: step ``step + i``'s prompts and sampling). Returns (rollouts, episode metrics, the
        weight version that drew them: the loop step whose weights the engine held)."""
        self._check_reissued(step, prompts)
        rollouts, metrics, weights_step = self.rollouts.take(
            step, prompts, sampling, job, self.should_stop
        )
        self.rollouts.submit_ahead(step, upcoming, job)
        return rollouts, metrics, weights_step

    def expect_reissue(self, reissue: dict[int, list[int]]) -> None:
        """A checkpoint loaded after this schedule was built (a strategy that restores after ``on_fit_start``)."""
        self._reissue = dict(reissue)

    def record(self, checkpoint: dict) -> None:
        """The prompts in flight go into the checkpoint (with the data position, which has not passed them)."""
        checkpoint[KEY] = {"in_flight": self.rollouts.in_flight()}

    def _check_reissued(self, step: int, prompts: Sequence[Prompt]) -> None:
        """A resumed run draws the checkpoint's in-flight prompts again; say so, and warn when the data gives
        others."""
        if step not in self._reissue:
            return
        ids = self._reissue.pop(step)
        drawn = [p.id for p in prompts]
        if ids == drawn:
            log.info(
                "loop step %d: drawing again the %d prompts that were in flight at the checkpoint",
                step,
                len(ids),
            )
        else:
            log.warning(
                "loop step %d: the checkpoint had prompts %s in flight but the data now gives %s (the prompt "
                "source changed since the checkpoint?)",
                step,
                ids[:8],
                drawn[:8],
            )


def in_flight_of(checkpoint: dict, rank: int) -> dict[int, list[int]]:
    """The prompts a loaded checkpoint had in flight (drawn again). Rank 0 writes checkpoints, so they hold rank 0's
    prompts: the other ranks have their own and skip the check."""
    if rank != 0:
        return {}
    return dict(checkpoint.get(KEY, {}).get("in_flight", {}))
