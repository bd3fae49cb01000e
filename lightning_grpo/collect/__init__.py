"""One rollout, owned by the ``Collector``: prompts -> draw -> rewards -> shaping / refill -> advantages ->
``RolloutBatch``. No Lightning in here (docs/collect.md)."""

from lightning_grpo.collect.async_rollouts import unwrapped
from lightning_grpo.collect.collector import Collector
from lightning_grpo.collect.draw import Drawer, episode_runner
from lightning_grpo.collect.prompts import StepSampling, step_prompts
from lightning_grpo.collect.rewards import RewardScorer
from lightning_grpo.collect.rows import RewardParts, StepRows
from lightning_grpo.collect.schedule import (
    AsyncSchedule,
    draws_ahead,
    in_flight_of,
    schedule_of,
)
from lightning_grpo.collect.wiring import (
    CollectParts,
    certifier_of,
    episodes_of,
    wire_collector,
)

__all__ = [
    "AsyncSchedule",
    "CollectParts",
    "Collector",
    "Drawer",
    "RewardParts",
    "RewardScorer",
    "StepRows",
    "StepSampling",
    "certifier_of",
    "draws_ahead",
    "episode_runner",
    "episodes_of",
    "in_flight_of",
    "schedule_of",
    "step_prompts",
    "unwrapped",
    "wire_collector",
]
