"""The contract between GRPOModule and whoever keeps its rollout engine current (``HandoffCallback``).

An engine that holds weights of its own (vLLM, or any engine that does not generate with the
policy module itself) samples from a stale policy unless the trainer's weights are published to it
after every update. ``GRPOModule`` finds the one Trainer callback implementing ``WeightPublisher``
when it builds its engine (``on_fit_start``), and when there is none and the engine needs one, it
attaches a ``HandoffCallback`` itself: a run never trains on a stale engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from lightning.pytorch import Trainer
from torch import nn

from lightning_grpo.rollout.base import HoldsWeights, RolloutEngine, SamplesWithModule
from lightning_grpo.timing import StepTimer


@runtime_checkable
class WeightPublisher(Protocol):
    """Publishes the policy into the engine once per loop step; told by the module about each in-step boundary.

    ``GRPOModule`` calls ``on_engine_ready`` once per fit, right after building the engine (before Lightning
    restores optimizer state), then per loop step ``on_rollout_end`` after generation and ``on_update_end``
    after the update. Publication must happen before the next generation (``HandoffCallback`` does it in
    ``on_train_batch_start`` and before validation), timed as the phase ``sync`` of the module's ``timer``.
    """

    @property
    def sleeps_engine(self) -> bool:
        """Whether the engine is put to sleep between generations (False: build it without sleep mode)."""
        ...

    def on_engine_ready(
        self,
        trainer: Trainer,
        engine: RolloutEngine,
        policy: nn.Module,
        sync_bucket_mb: float,
        timer: StepTimer | None = None,
    ) -> None: ...

    def on_rollout_end(self, trainer: Trainer) -> None: ...

    def on_update_end(self, trainer: Trainer, loop_step: int) -> None: ...


class NoPublisher:
    """The engine generates with the policy itself (or holds no weights): nothing to publish or hand off."""

    sleeps_engine = False

    def on_engine_ready(
        self,
        trainer: Trainer,
        engine: RolloutEngine,
        policy: nn.Module,
        sync_bucket_mb: float,
        timer: StepTimer | None = None,
    ) -> None:
        pass

    def on_rollout_end(self, trainer: Trainer) -> None:
        pass

    def on_update_end(self, trainer: Trainer, loop_step: int) -> None:
        pass


def generates_with(engine: RolloutEngine, policy: nn.Module) -> bool:
    """The engine samples with the trained module itself (``HFEngine(policy)``): there is nothing to publish."""
    return isinstance(engine, SamplesWithModule) and engine.model is policy


def needs_publisher(engine: RolloutEngine, policy: nn.Module) -> bool:
    """The engine samples from weights of its own (unless it says it holds none), which go stale after every
    update unless published."""
    holds = engine.holds_weights if isinstance(engine, HoldsWeights) else True
    return not generates_with(engine, policy) and holds


def find_publisher(callbacks: Iterable[object]) -> WeightPublisher | None:
    """The one publisher among ``callbacks``; two would each sleep, wake and sync the same engine."""
    found = [cb for cb in callbacks if isinstance(cb, WeightPublisher)]
    if len(found) > 1:
        names = ", ".join(type(cb).__name__ for cb in found)
        raise ValueError(
            f"Trainer(callbacks=[...]) holds {len(found)} weight publishers ({names}): keep one "
            "HandoffCallback; each would sleep, wake and sync the same engine"
        )
    return found[0] if found else None


def engine_sleeps(callbacks: Iterable[object]) -> bool:
    """Whether the one publisher among ``callbacks`` puts the engine to sleep between generations (none: never)."""
    publisher = find_publisher(callbacks)
    return publisher is not None and publisher.sleeps_engine
