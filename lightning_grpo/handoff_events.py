"""The hand-off's vocabulary: the events of one loop step's cycle, in order, and the phases between them.

``HandoffCallback.events`` logs these names; docs/handoff.md and the tests compare against ``CYCLE``.
"""

from __future__ import annotations

from enum import Enum

GENERATE = "generate"
ENGINE_SLEEP = "engine.sleep"
TRAINER_ONLOAD = "trainer.onload"
TRAIN = "train"
WAKE_WEIGHTS = "engine.wake_up(weights)"
WEIGHT_SYNC = "weight_sync"
TRAINER_OFFLOAD = "trainer.offload"
WAKE_KV_CACHE = "engine.wake_up(kv_cache)"
CYCLE = (
    GENERATE,
    ENGINE_SLEEP,
    TRAINER_ONLOAD,
    TRAIN,
    WAKE_WEIGHTS,
    WEIGHT_SYNC,
    TRAINER_OFFLOAD,
    WAKE_KV_CACHE,
)
"""One loop step's events, in order, with colocated offload on."""


class Phase(str, Enum):
    IDLE = "idle"
    """Outside fit, or before the run reached its first batch boundary."""
    BOUNDARY = "boundary"
    """Trainer resident, engine asleep (colocated); publication pending. Checkpoints are taken here."""
    PUBLISH = "publish"
    """Waking the engine's weights, syncing, offloading the trainer, waking the KV cache."""
    GENERATE = "generate"
    """Engine awake with the current policy, trainer offloaded."""
    TRAIN = "train"
    """Engine asleep, trainer resident, the update running."""
