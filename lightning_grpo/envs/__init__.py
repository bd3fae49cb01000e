"""Multi-turn environments and tools, token in token out (docs/environments.md).

``EnvConfig`` selects an environment (``model.env``); ``EpisodeRunner`` plays its episodes with any rollout engine;
the record of an episode is the sampled ids plus the environment's ids, with ``Rollout.model_mask`` telling them
apart so only the sampled ones are trained.
"""

from lightning_grpo.envs.config import EnvConfig
from lightning_grpo.envs.environment import BUILTIN_ENVS, Environment, load_env
from lightning_grpo.envs.episode import EpisodeRunner
from lightning_grpo.envs.parse import PARSERS, ToolCall, parse_hermes, parse_pythonic

__all__ = [
    "BUILTIN_ENVS",
    "PARSERS",
    "EnvConfig",
    "Environment",
    "EpisodeRunner",
    "ToolCall",
    "load_env",
    "parse_hermes",
    "parse_pythonic",
]
