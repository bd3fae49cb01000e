"""What a GRPO module asks of the Trainer it runs in: its datamodule's prompt side, whether a publisher puts the
engine to sleep, the publisher itself, and the polls that let a SIGTERM end a long wait.

Each is read from the Trainer when asked, at the hook that needs it, never captured before ``fit`` (a user may build
the model first). A module driven by hand (no Trainer) gets the answers of no fit: no datamodule, nothing to poll, an
engine that never sleeps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Checkpoint
from torch import nn

from lightning_grpo.checkpoint.signals import stop_poll
from lightning_grpo.data.seam import PromptProvider, prompt_provider
from lightning_grpo.handoff import HandoffCallback
from lightning_grpo.publisher import (
    NoPublisher,
    WeightPublisher,
    engine_sleeps,
    find_publisher,
    needs_publisher,
)
from lightning_grpo.rollout.base import RolloutEngine
from lightning_grpo.timing import StepTimer

log = logging.getLogger(__name__)


class TrainerSide:
    """The Trainer's answers to a GRPO module.

    Args:
        trainer: the Trainer the module is attached to, or None (driven by hand).
    """

    def __init__(self, trainer: Trainer | None) -> None:
        self.trainer = trainer

    @property
    def datamodule(self):
        """The fit's datamodule (any class), or None."""
        return getattr(self.trainer, "datamodule", None)

    @property
    def prompts(self) -> PromptProvider | None:
        """The datamodule's prompt side (refills, counters, fitting), or None: not a ``PromptProvider``, asked nothing."""
        return prompt_provider(self.trainer)

    @property
    def validation_draws(self) -> PromptProvider:
        """What validation reads (``val_samples_per_prompt``, ``val_pass_reward``): the prompt side, else the defaults
        (the greedy draw alone)."""
        return self.prompts or PromptProvider()

    @property
    def engine_sleeps(self) -> bool:
        """Whether the fit's publisher puts the engine to sleep between generations (no Trainer: never)."""
        return (
            engine_sleeps(self.trainer.callbacks) if self.trainer is not None else False
        )

    @property
    def strategy(self):
        """The Trainer's strategy (its kind decides the rules that need it), or None."""
        return getattr(self.trainer, "strategy", None)

    def stop_poll(self, waiting_on: str) -> Callable[[], bool] | None:
        """What a wait on ``waiting_on`` polls: a watched signal or Lightning's SIGTERM flag ends it (None: no Trainer,
        the wait runs to its end; ``checkpoint/signals.py``)."""
        return stop_poll(self.trainer, waiting_on)

    def publisher(
        self,
        engine: RolloutEngine,
        policy: nn.Module,
        sync_bucket_mb: float,
        timer: StepTimer | None = None,
    ) -> WeightPublisher:
        """The fit's publisher of ``policy`` to ``engine``, told the engine is ready (``on_engine_ready``): the
        Trainer's own, else one attached for an engine with weights of its own (``engine_publisher``), else
        ``NoPublisher``."""
        publisher = engine_publisher(self.trainer, engine, policy)
        publisher.on_engine_ready(self.trainer, engine, policy, sync_bucket_mb, timer)
        return publisher


def engine_publisher(
    trainer: Trainer, engine: RolloutEngine, policy: nn.Module
) -> WeightPublisher:
    """The fit's publisher: the Trainer's own; else, for an engine with weights of its own, a hand-off attached
    here (a run never samples stale weights); else ``NoPublisher``."""
    found = find_publisher(trainer.callbacks)
    if found is not None or not needs_publisher(engine, policy):
        return found or NoPublisher()
    # the engine was built without sleep mode
    publisher = HandoffCallback(colocated_offload=False)
    callbacks = trainer.callbacks
    at = next(
        (i for i, cb in enumerate(callbacks) if isinstance(cb, Checkpoint)),
        len(callbacks),
    )
    # before checkpoint callbacks, as Lightning orders them
    callbacks.insert(at, publisher)
    if trainer.is_global_zero:
        log.warning(
            "%s holds weights of its own and no callback publishes them: attached "
            "HandoffCallback(colocated_offload=False) to sync them once per loop step. Pass "
            "HandoffCallback() in Trainer(callbacks=...) for the colocated sleep/wake hand-off.",
            type(engine).__name__,
        )
    return publisher
