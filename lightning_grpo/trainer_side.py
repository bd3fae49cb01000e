"""What a GRPO module asks of the Trainer it runs in: its datamodule's prompt side, whether a publisher puts the
engine to sleep, the publisher itself, and the polls that let a SIGTERM end a long wait.

Each is read from the Trainer when asked, at the hook that needs it, never captured before ``fit`` (a user may build
the model first). A module driven by hand (no Trainer) gets the answers of no fit: no datamodule, nothing to poll, an
engine that never sleeps.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch import Trainer
from torch import nn

from lightning_grpo.checkpoint.signals import stop_poll
from lightning_grpo.data.seam import PromptProvider, prompt_provider
from lightning_grpo.handoff import engine_publisher
from lightning_grpo.publisher import WeightPublisher, engine_sleeps
from lightning_grpo.rollout.base import RolloutEngine
from lightning_grpo.timing import StepTimer


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
        Trainer's own, else one attached for an engine with weights of its own (``handoff.engine_publisher``), else
        ``NoPublisher``."""
        publisher = engine_publisher(self.trainer, engine, policy)
        publisher.on_engine_ready(self.trainer, engine, policy, sync_bucket_mb, timer)
        return publisher
