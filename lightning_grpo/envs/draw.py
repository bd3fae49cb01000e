"""The module's one seam to environments: single-turn completions, or episodes when ``model.env`` is set."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_grpo.async_rollouts import training_draw
from lightning_grpo.envs.episode import EpisodeRunner
from lightning_grpo.rollout.base import Prompt, Rollout, SamplingConfig
from lightning_grpo.rollout.prefetch import AsyncRollouts


def episode_runner(module) -> EpisodeRunner | None:
    """The module's runner, built once from ``module.env_cfg`` (None: single-turn). Loads the environment class, so
    every refusal (import, tools, chat template) happens here, before the engine starts."""
    if module.env_cfg is None:
        return None
    if getattr(module, "_episodes", None) is None:
        tok = module.tokenizer
        eos = [tok.eos_token_id, *_ids(getattr(getattr(module.policy, "generation_config", None), "eos_token_id", None))]
        stops = [i for i in eos if i is not None]
        module._episodes = EpisodeRunner(module.env_cfg, tok, stops, module.context_length())
    return module._episodes


def draw_rollouts(module, prompts: Sequence[Prompt], group_size: int | None = None,
                  sampling: SamplingConfig | None = None) -> tuple[list[Rollout], dict[str, float]]:
    """``group_size`` rollouts per prompt from ``module.engine``: completions, or episodes with their metrics.
    None = the training draw (``rl.group_size``, ``module.sampling()``); validation passes its own."""
    engine = module.engine
    if isinstance(engine, AsyncRollouts) and group_size is None and sampling is None:  # async: a training draw
        job = lambda ps, s: _draw(module, engine.engine, ps, module.rl.group_size, s)
        return training_draw(module, engine, prompts, job)
    group_size = module.rl.group_size if group_size is None else group_size
    sampling = module.sampling() if sampling is None else sampling
    return _draw(module, engine, prompts, group_size, sampling)


def _draw(module, engine, prompts: Sequence[Prompt], group_size: int,
          sampling: SamplingConfig) -> tuple[list[Rollout], dict[str, float]]:
    runner = episode_runner(module)
    if runner is None:
        return engine.generate(prompts, group_size, sampling), {}
    return runner.play(engine, prompts, group_size, sampling)


def _ids(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]
