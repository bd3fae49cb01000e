"""One rollout, owned by the ``Collector``: prompts -> draw -> rewards -> shaping / refill -> advantages ->
``RolloutBatch``. No Lightning in here (docs/collect.md)."""

from lightning_grpo.collect.collector import Collector
from lightning_grpo.collect.draw import Drawer, episode_runner
from lightning_grpo.collect.prompts import StepSampling, step_prompts
from lightning_grpo.collect.rewards import RewardScorer
from lightning_grpo.collect.rows import RewardParts, StepRows
from lightning_grpo.collect.schedule import AsyncSchedule, draws_ahead, in_flight_of, schedule_of

__all__ = ["AsyncSchedule", "Collector", "Drawer", "RewardParts", "RewardScorer", "StepRows", "StepSampling",
           "draws_ahead", "episode_runner", "in_flight_of", "schedule_of", "step_prompts"]
