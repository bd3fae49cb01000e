"""``EnvConfig``: the multi-turn environment a run's rollouts play in (``model.env``; None = single-turn)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_grpo.checks import is_finite, is_int, raise_problems


@dataclass
class EnvConfig:
    """A multi-turn environment with tools: each rollout is an episode of model turns and tool results."""

    name: str = "calculator"
    """The environment class: a built-in name (``calculator``) or ``module:Class`` importable from the working folder
    (a TRL ``environment_factory`` class runs unchanged; docs/environments.md)."""
    max_turns: int = 4
    """Model turns per episode at most; an episode still calling tools after its last turn counts as truncated."""
    max_tool_response_tokens: int = 64
    """A tool result longer than this many tokens is cut (counted in ``episode/tool_results_cut``)."""
    max_total_tokens: int | None = None
    """Opening (prompt with the tool schemas) + every turn of an episode, in tokens, at most: a turn never runs past it
    and reaching it ends the episode truncated. Never above the model context; None = the model context."""
    tool_timeout_s: float = 10.0
    """Seconds a tool call may run; past it the model reads a timeout error (a failure)."""
    tool_workers: int = 1
    """Episodes whose tool calls run at once (threads). Above 1, the calls of different episodes overlap (one episode's
    calls stay in order); the rollouts are the same as with 1 as long as each episode's environment instance keeps its
    state to itself. Worth it for tools that wait (HTTP, a sandbox process); a pure-Python tool holds the GIL."""
    parser: str = "hermes"
    """Tool-call format of the model's turns: ``hermes`` (Qwen2.5 / Qwen3 ``<tool_call>{json}</tool_call>``), another
    name registered in ``envs.parse.PARSERS``, or ``module:function``."""

    def __post_init__(self) -> None:
        raise_problems("model.env config", self.problems())

    def problems(self) -> list[str]:
        """Every broken rule as a ``field=value: rule; fix`` line."""
        p = [
            f"{name}={getattr(self, name)!r}: must be an integer >= 1"
            for name in ("max_turns", "max_tool_response_tokens", "tool_workers")
            if not is_int(getattr(self, name)) or getattr(self, name) < 1
        ]
        if self.max_total_tokens is not None and (
            not is_int(self.max_total_tokens) or self.max_total_tokens < 2
        ):
            p.append(
                f"max_total_tokens={self.max_total_tokens!r}: must be an integer >= 2, or null (derived)"
            )
        if not is_finite(self.tool_timeout_s) or self.tool_timeout_s <= 0:
            p.append(
                f"tool_timeout_s={self.tool_timeout_s!r}: must be a number of seconds > 0"
            )
        if not isinstance(self.name, str) or not self.name:
            p.append(
                f"name={self.name!r}: must be a built-in environment name or 'module:Class'"
            )
        return p
