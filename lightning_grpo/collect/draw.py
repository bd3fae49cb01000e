"""Drawing one round: ``group_size`` rollouts per prompt from the engine, as completions or, with ``model.env``,
as multi-turn episodes (``envs/episode.py``: the model's sampled ids with the environment's tokens appended)."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_grpo.envs.config import EnvConfig
from lightning_grpo.envs.episode import EpisodeRunner
from lightning_grpo.rollout.base import Prompt, Rollout, RolloutEngine, SamplingConfig


def episode_runner(
    env: EnvConfig | None, tokenizer, generation_eos, context: int | None
) -> EpisodeRunner | None:
    """The runner of ``model.env`` (None: single-turn). Loads the environment class, so every refusal (import,
    tools, chat template) happens here, before an engine starts.

    Args:
        env: the environment section, or None.
        tokenizer: the policy's tokenizer.
        generation_eos: the policy's ``generation_config.eos_token_id`` (an id, a list of ids, or None).
        context: the model context in tokens (None = unknown).
    """
    if env is None:
        return None
    eos = [tokenizer.eos_token_id, *_ids(generation_eos)]
    return EpisodeRunner(env, tokenizer, [i for i in eos if i is not None], context)


class Drawer:
    """Draws rollouts with one engine: completions, or episodes when an ``EpisodeRunner`` is given.

    Args:
        engine: the engine that samples (under async rollouts the wrapped one: the schedule calls this drawer on its
            worker thread).
        episodes: the multi-turn runner, or None for single-turn completions.
    """

    def __init__(self, engine: RolloutEngine, episodes: EpisodeRunner | None) -> None:
        self.engine = engine
        self.episodes = episodes

    def __call__(
        self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingConfig
    ) -> tuple[list[Rollout], dict[str, float]]:
        """``group_size`` rollouts per prompt, groups contiguous in prompt order, and the episodes' metrics."""
        if self.episodes is None:
            return self.engine.generate(prompts, group_size, sampling), {}
        return self.episodes.play(self.engine, prompts, group_size, sampling)


def _ids(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]
