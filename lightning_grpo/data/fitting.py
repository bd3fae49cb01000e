"""Fit a datamodule's prompts to the module that trains on them, before any step runs: a text-only policy refuses
images, OPD refuses pixels, dynamic sampling needs a refill lane, prompts are templated and cut to
``max_prompt_tokens``, and every column a reward function reads must exist."""

from __future__ import annotations

from lightning_grpo.data.rewards import check_reward_columns
from lightning_grpo.data.seam import PromptProvider


def fit_prompts(module, dm) -> None:
    """``GRPOModule.check_data``: raise the first problem with ``dm`` for ``module``, else prepare its prompts."""
    if not isinstance(dm, PromptProvider):
        if module.rl.dynamic_sampling:
            raise ValueError(f"rl.dynamic_sampling=true refills from the datamodule's refill lane, which "
                             f"{type(dm).__name__} lacks (not a PromptProvider); use PromptDataModule")
        return
    if module.vision is None and dm.has_images:
        raise ValueError(
            f"data.source={_source_name(dm)} has prompts with images but policy.path="
            f"{module.policy_cfg.path!r} is a text-only model; use a vision-language policy (Qwen2-VL, Qwen2.5-VL, "
            "Qwen3-VL, or tiny.arch=qwen2_5_vl) or a text-only data source"
        )
    if dm.has_images and module.objective.name != "grpo":  # OPD scores hidden states, no pixels
        raise ValueError(f"model.objective={module.objective.name} does not score prompts with images (data.source="
                         f"{_source_name(dm)} has some); use model.objective=grpo for image prompts")
    dm.prepare_prompts(module.tokenizer, module.max_prompt_tokens(), module.rollout_cfg.long_prompts)
    check_reward_columns(module.reward_specs or [], dm.columns)


def _source_name(dm) -> str:
    source = getattr(dm, "source", "?")
    return repr(source) if isinstance(source, str) else f"<{type(source).__name__}>"
