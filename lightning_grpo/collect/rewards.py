"""Scoring a draw: one total reward per rollout, the per-function parts kept for the completions log.

``RewardScorer`` is the default of ``GRPOModule.compute_rewards`` (a subclass may score its own way and call it):
recorded rewards (a replay file; an environment's, shown as the part ``environment``) are used as they are,
``rewards: []`` scores every rollout 0 (distillation alone), else the configured functions (``data/rewards.py``),
their weighted sum, with each function's mean over the samples it scored and the share of rows with no opinion as
metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_grpo.collect.rows import RewardParts
from lightning_grpo.data.rewards import RewardSpec, score
from lightning_grpo.rollout.base import Rollout


class RewardScorer:
    """The run's reward functions, and the parts of what they scored in the current loop step.

    Args:
        specs: the reward functions (None = the built-in task's reward; ``[]`` = none, all rewards 0).
        should_stop: polled while a function runs; a SIGTERM / SIGUSR1 abandons the call (None: never polled).
    """

    def __init__(
        self,
        specs: list[RewardSpec] | None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.specs = specs
        self.should_stop = should_stop
        self.parts = RewardParts()
        """Per-function rewards of this loop step's rollouts (``completions.jsonl``)."""

    def begin_step(self) -> None:
        """A new loop step: the parts kept so far belong to the last one's rows."""
        self.parts = RewardParts()

    def __call__(self, rollouts: Sequence[Rollout]) -> tuple[Tensor, dict[str, float]]:
        """``([N] float32 total rewards, metrics)``."""
        if all(r.reward is not None for r in rollouts):
            total = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
            # the environments' own rewards, shown as a part
            if all(r.transcript is not None for r in rollouts):
                self.parts.add(list(rollouts), {"environment": total})
            return total, {}
        if self.specs == []:
            return torch.zeros(len(rollouts), dtype=torch.float32), {}
        total, parts = score(
            rollouts, self.specs or [RewardSpec()], should_stop=self.should_stop
        )
        self.parts.add(rollouts, parts)
        # Per function: the mean over the samples it scored (None = no opinion, NaN in ``parts``).
        metrics = {f"reward/{name}": float(v.nanmean()) for name, v in parts.items()}
        metrics["reward/none_frac"] = float(
            torch.stack(list(parts.values())).isnan().float().mean()
        )
        return total, metrics
