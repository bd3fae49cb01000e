"""The rollout-engine protocol every generator implements (transformers, vLLM, replay), and the optional
capabilities some engines add (typed ``Protocol``s checked with ``isinstance``, never attribute probing)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from lightning_grpo.checks import is_finite, is_int, raise_problems

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
    top_k: int = 0
    """Keep only the k most likely tokens; 0 = off."""
    logprobs: bool = False
    """Return the sampler's per-token logprobs (needed by ``rl.rollout_correction``)."""
    seed: int | None = None
    """Seed of this draw: completion j of prompt p draws from a stream seeded by (seed, p.id, j)
    (``rollout/sampler.py``). None = unseeded (the engines take one number from torch's global generator)."""
    stop: tuple[str, ...] = ()
    """Stop strings: the completion ends with the token that completes one (see ``cut_at_stop``)."""
    forbidden_token_ids: tuple[int, ...] = ()
    """Tokens a completion may not hold (a VLM's vision tokens: an image placeholder in a completion would claim an
    image that is not there). A completion ends right before the first one it samples (``finish_reason="length"``);
    sampling itself is untouched, so sampler logprobs still equal the policy's (no renormalization)."""

    def __post_init__(self) -> None:
        raise_problems("sampling config", self.problems())

    def problems(self) -> list[str]:
        """Every broken rule as a ``field=value: rule`` line (``RolloutConfig`` checks the user's values first)."""
        p = []
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            p.append(f"max_new_tokens={self.max_new_tokens!r}: must be an integer >= 1")
        if not is_finite(self.temperature) or self.temperature < 0:
            p.append(
                f"temperature={self.temperature!r}: must be a finite number >= 0 (0 = greedy)"
            )
        if not is_finite(self.top_p) or not 0 < self.top_p <= 1:
            p.append(f"top_p={self.top_p!r}: must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            p.append(f"top_k={self.top_k!r}: must be an integer >= 0 (0 = off)")
        if not all(isinstance(s, str) and s for s in self.stop):
            p.append(f"stop={self.stop!r}: must be non-empty strings")
        return p


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
    """The dataset row's other columns (handed to reward functions), plus the stream's ``source_index``/``epoch``."""
    messages: list[dict] | None = None
    """Chat messages of a conversational prompt (``text`` is then its chat-templated string); None = plain text."""
    images: tuple = ()
    """Image references of the prompt, in placeholder order (``data/images.py``); ``token_ids`` then hold each
    image's expanded placeholder tokens (``vision.VisionProcessor.expand``)."""


@dataclass(frozen=True)
class Turn:
    """One model turn of a multi-turn episode, kept for people to read (the trained record is the token ids)."""

    text: str
    """The turn's text as the engine decoded it."""
    tokens: int
    """Ids the sampler drew in this turn: trained (``model_mask`` True)."""
    calls: tuple[dict, ...] = ()
    """The tool calls the turn made, in order: ``{"name", "arguments", "result", "failed"}`` (``result`` the text
    the model read back, cut as it was; None: not run, the episode ended first; an unreadable call has ``name``
    ``"error"`` and the parser's message as its result)."""
    context_tokens: int = 0
    """Ids appended after the turn (the chat template's delta around the results): context, never trained."""


@dataclass(frozen=True)
class Transcript:
    """A multi-turn episode as the model saw it, for the completions log (``envs/episode.py`` fills it)."""

    opening: str
    """The prompt as the model saw it: the messages rendered by the chat template, tool schemas included."""
    turns: tuple[Turn, ...]
    """Every model turn, with its calls and their results."""


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
    """Set by engines that serve recorded rewards (replay) and by environments (``envs/``); None means 'score me'."""
    model_mask: list[bool] | None = None
    """Per completion token, True where the policy sampled it. None = all of them (a single-turn completion); a
    multi-turn episode (``envs/episode.py``) holds tool results and turn separators as False: context only."""
    transcript: Transcript | None = None
    """A multi-turn episode's turns, calls and results as text (None: a single-turn completion)."""
    versions: list[int] | None = None
    """Per completion token, the weight version that sampled it (``rollout.server.inflight_updates``: a sync may land
    mid-completion). None = the whole completion was sampled by the weights its batch was drawn with."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the loop needs from a generator. ``sleep``/``wake_up`` are idempotent."""

    def generate(
        self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingConfig
    ) -> list[Rollout]:
        """``group_size`` rollouts per prompt, grouped: prompt 0's group first."""
        ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None: ...

    def reset_prefix_cache(self) -> None: ...


# -- capabilities: what some engines offer beyond the protocol, each checked with ``isinstance`` ----------------------
@runtime_checkable
class Closable(Protocol):
    """Holds resources beyond this process's memory (vLLM's workers, launched servers): ``close`` frees them."""

    def close(self) -> None: ...


@runtime_checkable
class SamplesWithModule(Protocol):
    """Generates with a torch module it was handed (``HFEngine``); when that is the trained policy itself, a weight
    sync has nothing to move."""

    model: nn.Module


@runtime_checkable
class HoldsWeights(Protocol):
    """Says whether it samples from weights of its own; an engine without this capability is taken to hold them.
    ``holds_weights = False`` (recorded rollouts) means nothing is published to it."""

    holds_weights: bool


@runtime_checkable
class WeightDtype(Protocol):
    """Holds its weights in one dtype (vLLM): ``push_weights`` casts each bucket to it (None: as the trainer has it)."""

    dtype: torch.dtype | None


@runtime_checkable
class WeightDevice(Protocol):
    """Takes its weights on one device (a server: the host): ``push_weights`` moves each bucket there (None: as the
    trainer has it)."""

    device: torch.device | None


@runtime_checkable
class DeclaresWeights(Protocol):
    """Can name every tensor it holds (the hand-off checks that a sync after a level-2 sleep rewrote each)."""

    def weight_names(self) -> list[str]:
        """Every tensor name a full sync must write; an empty list: it cannot say."""
        ...


@runtime_checkable
class LoadsAdapters(Protocol):
    """Can take a LoRA adapter itself (vLLM built with a LoRA rank) instead of merged weights."""

    @property
    def serves_adapters(self) -> bool:
        """Whether it was built to serve adapters (else it takes merged weights like any engine)."""
        ...

    def load_adapter(self, tensors: dict[str, Tensor], config_json: str) -> None: ...


@runtime_checkable
class Served(Protocol):
    """Samples in other processes (``vllm serve``) that outlive this one unless closed."""

    @property
    def server(self) -> object | None:
        """The server process it launched (stopped by ``close``); None for a server at a URL, left running."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class UpdatesInFlight(Protocol):
    """A weight sync may land while requests are in flight (``rollout.server.inflight_updates``): each token then
    records the engine's weight ``version`` that sampled it (``Rollout.versions``)."""

    version: int
    """The engine's weight version now: one more per sync."""

    @property
    def updates_in_flight(self) -> bool:
        """True: a sync cuts the requests in flight and they continue under the new weights."""
        ...


@runtime_checkable
class RestartsServers(Protocol):
    """Starts a launched server that died again (``VLLMServerEngine``, ``rollout.server.restarts``)."""

    @property
    def server_restarts(self) -> int:
        """Servers started again so far in this run (``rollout/server_restarts``)."""
        ...

    def hold_restarts(self, thread: threading.Thread) -> None:
        """A draw on ``thread`` (the async worker) that meets a dead server raises: ``recover`` repairs it."""
        ...

    def recover(self, err: BaseException) -> bool:
        """After a draw failed with ``err``: True once the server runs again with the trainer's weights; False:
        ``err`` stands. Call it from the thread that owns the weights, with no draw under way."""
        ...


@runtime_checkable
class DrawsAhead(Protocol):
    """Draws training batches ahead of the update (``rollout.max_off_policy_steps``, ``AsyncRollouts``)."""

    max_off_policy_steps: int


@dataclass(frozen=True)
class VocabDraw:
    """One probe completion and the whole next-token distribution the engine drew each of its tokens from."""

    token_ids: list[int]
    """``[T]`` completion tokens."""
    logprobs: Tensor
    """``[T, V]`` float32 log-probabilities over the vocabulary at each completion position."""


@runtime_checkable
class ScoresVocabulary(Protocol):
    """Returns the whole next-token distribution it samples from, not just the sampled token's logprob (the
    consistency certificate, ``lightning_grpo/certificate.py``)."""

    def vocabulary_logprobs(
        self, prompts: Sequence[Prompt], max_new_tokens: int, seed: int
    ) -> list[VocabDraw]:
        """One completion per prompt at temperature 1 (no top-k, no top-p), seeded per prompt id: the model's own
        distribution at every position, as the engine computes it when it samples."""
        ...


def cut_before_forbidden(
    token_ids: Sequence[int], forbidden: Sequence[int]
) -> tuple[list[int], bool]:
    """``(tokens before the first forbidden one, whether one was found)``; the same for every engine."""
    ids = list(token_ids)
    bad = set(forbidden)
    at = next((i for i, t in enumerate(ids) if t in bad), None)
    return (ids, False) if at is None else (ids[:at], True)


def cut_at_stop(
    token_ids: Sequence[int], stop: Sequence[str], decode
) -> tuple[list[int], str, bool]:
    """``(tokens, text, stopped)``: a completion cut at its first stop string, the same for every engine.

    The tokens end with the first one whose text completes a stop string (it was sampled, so it is trained on);
    the text is ``decode`` of them cut right before that string (what vLLM returns by default). With no stop
    string in the text the completion comes back whole. ``decode`` maps token ids to text.
    """
    ids = list(token_ids)
    text = decode(ids)
    if not any(s in text for s in stop):
        return ids, text, False
    # the shortest prefix whose text holds a stop string (containment only grows)
    lo = 1
    hi = len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        prefix = decode(ids[:mid])
        if any(s in prefix for s in stop):
            hi = mid
        else:
            lo = mid + 1
    text = decode(ids[:lo])
    return ids[:lo], text[: min(text.find(s) for s in stop if s in text)], True


def finish_rollout(
    prompt: Prompt,
    ids: Sequence[int],
    text: str,
    finish: str,
    logprobs: Sequence[float] | None,
    sampling: SamplingConfig,
    decode,
) -> Rollout:
    """An engine's raw completion as a ``Rollout``: cut before a forbidden token, then at the first stop string,
    exactly as ``HFEngine`` does (``decode`` maps token ids to text; needed only with stop strings or forbidden
    tokens). ``finish`` must be ``stop`` or ``length``."""
    if finish not in ("stop", "length"):
        raise RuntimeError(
            f"the engine finished prompt id={prompt.id} with reason {finish!r}"
        )
    ids = list(ids)
    logprobs = None if logprobs is None else list(logprobs)
    ids, cut = cut_before_forbidden(ids, sampling.forbidden_token_ids)
    if cut:  # a vision token: the completion ends before it, unfinished
        text = decode(ids)
        finish = "length"
        logprobs = None if logprobs is None else logprobs[: len(ids)]
    # tokens up to the one completing the stop string, text cut before it: exactly as HFEngine
    if sampling.stop:
        ids, text, _ = cut_at_stop(ids, sampling.stop, decode)
        logprobs = None if logprobs is None else logprobs[: len(ids)]
    return Rollout(
        prompt=prompt, token_ids=ids, text=text, finish_reason=finish, logprobs=logprobs
    )
