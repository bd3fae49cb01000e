"""The rollout-engine protocol every generator implements (transformers, vLLM, replay)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from torch import Tensor

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are drawn."""

    max_new_tokens: int = 64
    """Completion length cap, in tokens."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    logprobs: bool = False
    """Return the sampler's per-token logprobs (needed by ``use_rollout_logprobs_for_loss``)."""
    seed: int | None = None
    """Seed for this draw (engines derive per-rank, per-step streams from it)."""


@dataclass(frozen=True)
class Prompt:
    """One prompt to complete ``group_size`` times."""

    id: int
    """Deterministic prompt id (the group id of its completions)."""
    token_ids: list[int]
    """Prompt tokens, no padding."""
    text: str = ""
    answer: str | None = None
    """Reference answer for verifiable rewards, if the task has one."""
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Rollout:
    """One completion of one prompt."""

    prompt: Prompt
    token_ids: list[int]
    """Completion tokens (EOS included when the sampler stopped on it)."""
    text: str
    finish_reason: FinishReason
    logprobs: list[float] | None = None
    """Sampler logprob of each completion token, when asked for."""
    reward: float | None = None
    """Set by engines that serve recorded rewards (replay); None means 'score me'."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the loop needs from a generator. ``sleep``/``wake_up`` are idempotent."""

    def generate(self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingConfig) -> list[Rollout]:
        """``group_size`` rollouts per prompt, grouped: prompt 0's group first."""
        ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None: ...

    def reset_prefix_cache(self) -> None: ...
