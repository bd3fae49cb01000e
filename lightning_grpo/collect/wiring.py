"""A Collector wired from explicit parts, once the engine exists and the strategy has set up the ranks.

``GRPOModule.configure_collector`` gathers the parts (its engine, its policy's side, its sections, its ranks) and
calls ``wire_collector``; nothing here sees the module. The episode runner and the consistency certificate, which
the module builds earlier or beside the Collector, are wired here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_grpo.certificate import Certifier, probe_prompts
from lightning_grpo.collect.collector import Collector, Score
from lightning_grpo.collect.draw import Drawer, episode_runner
from lightning_grpo.collect.prompts import StepSampling
from lightning_grpo.collect.rewards import RewardScorer
from lightning_grpo.collect.schedule import schedule_of
from lightning_grpo.config import GRPOConfig, RolloutConfig
from lightning_grpo.data.seam import PromptProvider
from lightning_grpo.distributed import ONE_PROCESS_GROUP, DataParallelGroup
from lightning_grpo.envs import EnvConfig, EpisodeRunner
from lightning_grpo.rollout.base import RolloutEngine
from lightning_grpo.rollout.certificate_config import CertificateConfig
from lightning_grpo.vision import VisionProcessor


@dataclass(frozen=True)
class CollectParts:
    """What one rollout is wired from."""

    engine: RolloutEngine
    """The engine (an ``AsyncRollouts`` when it draws ahead: a schedule then owns its draws)."""
    episodes: EpisodeRunner | None
    """``model.env``'s runner (None: single-turn completions)."""
    score: Score
    """Rollouts -> rewards (``GRPOModule.compute_rewards``, which a subclass may replace)."""
    rewards: RewardScorer
    """The reward functions, whose per-function parts the completions log shows."""
    rl: GRPOConfig
    """Group size, dynamic sampling, advantages, what counts in the loss."""
    rollout: RolloutConfig
    """``max_new_tokens`` (overlong shaping, length metrics)."""
    sampling: StepSampling
    """How each loop step samples on this rank."""
    tokenizer: Any
    """The policy's tokenizer (prompt encoding, pad and EOS ids)."""
    vision: VisionProcessor | None = None
    """A vision-language policy's image side (None: text-only)."""
    context: int | None = None
    """The policy's context in tokens (None: unknown)."""
    prompts: PromptProvider | None = None
    """The datamodule's prompt side (refills, counters), or None."""
    dp: DataParallelGroup = ONE_PROCESS_GROUP
    """The data-parallel ranks (batch-wide reward std, agreed refill rounds)."""
    waiting_stop: Callable[[], bool] | None = None
    """What the wait for rollouts in flight polls for a SIGTERM (None: it waits)."""
    in_flight: dict[int, list[int]] = field(default_factory=dict)
    """A loaded checkpoint's prompts in flight, drawn again (``in_flight_of``)."""
    certifier: Certifier | None = None
    """``rollout.certificate``, run before each training draw (``certifier_of``; None: off)."""


def wire_collector(parts: CollectParts) -> Collector:
    """The Collector of ``parts``: a drawer over the engine, and the async schedule when it draws ahead."""
    schedule = schedule_of(parts.engine, parts.waiting_stop, parts.in_flight)
    drawer = Drawer(parts.engine, parts.episodes)
    return Collector(
        drawer,
        parts.score,
        rewards=parts.rewards,
        rl=parts.rl,
        max_new_tokens=parts.rollout.max_new_tokens,
        sampling=parts.sampling,
        tokenizer=parts.tokenizer,
        vision=parts.vision,
        context=parts.context,
        prompts=parts.prompts,
        dp=parts.dp,
        schedule=schedule,
        certifier=parts.certifier,
    )


def episodes_of(
    env: EnvConfig | None, policy: nn.Module, tokenizer, context: int | None
) -> EpisodeRunner | None:
    """``model.env``'s runner for ``policy`` (None: single-turn); its generation config's EOS ids end a turn too."""
    generation = getattr(policy, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    return episode_runner(env, tokenizer, eos, context)


def certifier_of(
    cfg: CertificateConfig | None, policy: nn.Module, tokenizer, after_syncs: bool
) -> Certifier | None:
    """``rollout.certificate``: engine vs trainer at the first loop step and, when ``after_syncs`` (a publisher
    syncs the engine every loop step), after every sync. None: off."""
    if cfg is None:
        return None
    return Certifier(
        cfg, policy, probe_prompts(tokenizer, cfg.prompts), after_syncs=after_syncs
    )
