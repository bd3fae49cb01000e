"""Fit a datamodule's prompts to the policy that trains on them, before any step runs: a text-only policy refuses
images, OPD refuses pixels, dynamic sampling needs a refill lane, prompts are templated and cut to
``max_prompt_tokens``, and every column a reward function reads must exist."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_grpo.checks import ConfigError
from lightning_grpo.config import GRPOConfig, RolloutConfig
from lightning_grpo.data.chat import LongPromptsError
from lightning_grpo.data.rewards import RewardSpec, check_reward_columns
from lightning_grpo.data.seam import PromptProvider


@dataclass(frozen=True)
class PromptFit:
    """What prompts are fitted to: the trained policy's side and the run's rules (``GRPOModule.check_data``;
    ``PromptFit.of`` builds it from a built policy and the run's sections)."""

    tokenizer: Any
    """The policy's tokenizer: its chat template formats chat prompts, its ids count prompt tokens."""
    max_prompt_tokens: int | None
    """Prompts longer than this follow ``long_prompts``; None = no limit."""
    long_prompts: str
    """``rollout.long_prompts``: ``drop`` (counted) or ``error``."""
    reward_specs: Sequence[RewardSpec]
    """The reward functions: every column one of them reads must exist."""
    policy_path: str | None
    """``policy.path``, named when a text-only policy meets prompts with images."""
    vision: bool
    """Whether the policy has an image side (a vision-language model)."""
    objective: str
    """The objective's name: only ``grpo`` scores prompts with images."""
    dynamic_sampling: bool
    """``rl.dynamic_sampling``: refills from the datamodule's refill lane."""
    prompt_room: str | None = None
    """How ``max_prompt_tokens`` was derived from the context (``RolloutConfig.prompt_room``); None: set by the
    user. Named instead of the limit when prompts do not fit."""

    @classmethod
    def of(
        cls,
        tokenizer,
        context: int | None,
        rollout: RolloutConfig,
        rl: GRPOConfig,
        reward_specs: Sequence[RewardSpec] | None,
        policy_path: str | None,
        vision: bool,
        objective: str,
    ) -> PromptFit:
        """The fit of a built policy (its tokenizer, its context in tokens, whether it sees images) under the
        ``rollout`` and ``rl`` sections (the prompt limit is what ``max_new_tokens`` leaves of ``context``)."""
        return cls(
            tokenizer=tokenizer,
            max_prompt_tokens=rollout.prompt_limit(context),
            long_prompts=rollout.long_prompts,
            reward_specs=reward_specs or [],
            policy_path=policy_path,
            vision=vision,
            objective=objective,
            dynamic_sampling=rl.dynamic_sampling,
            prompt_room=rollout.prompt_room(context),
        )


def fit_prompts(fit: PromptFit, dm) -> None:
    """Raise the first problem with ``dm`` for ``fit``, else prepare its prompts."""
    if not isinstance(dm, PromptProvider):
        if fit.dynamic_sampling:
            raise ConfigError(
                f"rl.dynamic_sampling=true refills from the datamodule's refill lane, which "
                f"{type(dm).__name__} lacks (not a PromptProvider); use PromptDataModule"
            )
        return
    if not fit.vision and dm.has_images:
        raise ConfigError(
            f"data.source={_source_name(dm)} has prompts with images but policy.path="
            f"{fit.policy_path!r} is a text-only model; use a vision-language policy (Qwen2-VL, Qwen2.5-VL, "
            "Qwen3-VL, or tiny.arch=qwen2_5_vl) or a text-only data source"
        )
    if dm.has_images and fit.objective != "grpo":  # OPD scores hidden states, no pixels
        raise ConfigError(
            f"model.objective={fit.objective} does not score prompts with images (data.source="
            f"{_source_name(dm)} has some); use model.objective=grpo for image prompts"
        )
    try:
        dm.prepare_prompts(fit.tokenizer, fit.max_prompt_tokens, fit.long_prompts)
    except LongPromptsError as err:
        if fit.prompt_room is None:
            raise
        # the limit is what max_new_tokens left: name that knob, not a max_prompt_tokens the user never set
        raise ConfigError(
            f"{fit.prompt_room}, and the shortest prompt that does not fit has {err.shortest} tokens; "
            "lower rollout.max_new_tokens (or use a policy with a longer context)"
        ) from None
    check_reward_columns(fit.reward_specs, dm.columns)


def _source_name(dm) -> str:
    source = getattr(dm, "source", "?")
    return repr(source) if isinstance(source, str) else f"<{type(source).__name__}>"
