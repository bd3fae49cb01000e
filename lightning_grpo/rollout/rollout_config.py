"""``RolloutConfig``: how rollouts are produced (the ``rollout`` section; ``lightning_grpo.config`` re-exports it).

A plain dataclass beside the engines, like ``VLLMConfig``: it imports nothing but ``checks.py``, ``server_config.py``
and ``vllm_config.py``. Its rules that read another section too (``rl``, ``policy.lora``) are in
``lightning_grpo/run_check.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_grpo.checks import is_finite, is_int, raise_problems
from lightning_grpo.rollout.certificate_config import CertificateConfig
from lightning_grpo.rollout.server_config import ServerConfig
from lightning_grpo.rollout.vllm_config import VLLMConfig


@dataclass
class RolloutConfig:
    """How rollouts are produced for each collected batch."""

    engine: Literal["hf", "vllm", "vllm_server", "replay"] = "hf"
    """hf: transformers generate with the policy itself (CPU default); vllm: in-process vLLM; vllm_server: a
    ``vllm serve`` process (launched, or at a URL; see ``server``); replay: a JSONL file."""
    max_new_tokens: int = 32
    """Completion length cap, in tokens."""
    temperature: float = 1.0
    """Sampling temperature (also used to score logprobs in the update, so ratios compare like with like)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Sample among the k most likely tokens only; 0 = no top-k cut."""
    replay_path: str | None = None
    """JSONL of recorded rollouts when engine=replay."""
    vllm: VLLMConfig | None = None
    """How the vLLM engine is built when engine=vllm (None = VLLMConfig defaults)."""
    server: ServerConfig | None = None
    """The ``vllm serve`` engine when engine=vllm_server (None = ServerConfig defaults: launch one on a free port)."""
    sync_bucket_mb: float = 256.0
    """Weight-sync bucket size in MiB: one engine call per bucket (decoder layers are never split)."""
    stop: list[str] | None = None
    """Stop strings: a completion ends with the token that completes one (kept, so it is trained on; the text handed
    to rewards is cut before it), finish_reason "stop". The same on every engine. EOS always stops."""
    max_prompt_tokens: int | None = None
    """Longest prompt (in tokens, chat template included); None = the context (policy, or vllm.max_model_len) minus
    max_new_tokens. Longer prompts follow long_prompts, checked once before training."""
    max_off_policy_steps: int = 0
    """Async rollouts: the next loop steps' batches are drawn while this one updates, each with weights at most this
    many loop steps old (0 = generate, then update: the synchronous order). Needs engine=vllm_server and a
    rollout correction (docs/async.md)."""
    long_prompts: Literal["drop", "error"] = "drop"
    """Prompts over max_prompt_tokens: drop (counted in data/long_prompts_dropped, warned once) or error at setup."""
    certificate: CertificateConfig | None = None
    """The consistency certificate (engine vs trainer over the whole vocabulary, at the first loop step and after
    every weight sync; ``mismatch/*`` metrics, an alarm or a stop): engines hf and vllm. None = off
    (docs/consistency.md)."""

    def prompt_limit(self, context: int | None) -> int | None:
        """The prompt-length limit: ``max_prompt_tokens``, else the context left after the completion (the policy's
        ``context``, or the engine's ``max_model_len`` when smaller); None when neither is known."""
        if self.max_prompt_tokens is not None:
            return self.max_prompt_tokens
        known, _ = self.context(context)
        return None if known is None else max(known - self.max_new_tokens, 1)

    def context(self, policy_context: int | None) -> tuple[int | None, str]:
        """``(tokens, what sets them)``: the smaller of the policy's context and the engine's ``max_model_len``."""
        engine = {"vllm": self.vllm, "vllm_server": self.server}.get(self.engine)
        limit = engine.max_model_len if engine is not None else None
        if limit and (not policy_context or limit < policy_context):
            return limit, f"rollout.{self.engine.removeprefix('vllm_')}.max_model_len"
        return policy_context or None, "the policy's max_position_embeddings"

    def prompt_room(self, policy_context: int | None) -> str | None:
        """Where a derived prompt limit comes from, named when prompts do not fit (the knob the user set, not
        max_prompt_tokens); None when max_prompt_tokens is set or no context is known."""
        known, which = self.context(policy_context)
        if self.max_prompt_tokens is not None or known is None:
            return None
        room = max(known - self.max_new_tokens, 0)
        return (
            f"rollout.max_new_tokens={self.max_new_tokens} leaves {room} token{'s' * (room != 1)} of a "
            f"{known}-token context ({which}) for the prompt"
        )

    def __post_init__(self) -> None:
        raise_problems("rollout config", self.problems())

    def problems(self) -> list[str]:
        """Every broken rule as a ``field=value: rule; fix`` line."""
        return [*self._sampling_problems(), *self._engine_problems()]

    def _sampling_problems(self) -> list[str]:
        """The prompt and completion lengths, the stop strings and the sampling knobs."""
        p = []
        if self.max_new_tokens < 1:
            p.append(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.max_prompt_tokens is not None and (
            not is_int(self.max_prompt_tokens) or self.max_prompt_tokens < 1
        ):
            p.append(
                f"max_prompt_tokens={self.max_prompt_tokens}: must be a positive integer or null (the context)"
            )
        if self.long_prompts not in ("drop", "error"):
            p.append(f"long_prompts={self.long_prompts!r}: must be 'drop' or 'error'")
        if self.stop is not None and (
            not isinstance(self.stop, (list, tuple))
            or not all(isinstance(x, str) and x for x in self.stop)
        ):
            p.append(
                f"stop={self.stop!r}: must be a list of non-empty strings (or null)"
            )
        if not is_finite(self.temperature) or self.temperature <= 0:
            p.append(
                f"temperature={self.temperature}: must be > 0 for GRPO sampling (greedy groups have no spread)"
            )
        if not 0 < self.top_p <= 1:
            p.append(f"top_p={self.top_p}: must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            p.append(f"top_k={self.top_k}: must be an integer >= 0 (0 = off)")
        return p

    def _engine_problems(self) -> list[str]:
        """The engine and what it must support: async rollouts, the certificate, salts, in-flight updates."""
        p = []
        if not is_finite(self.sync_bucket_mb) or self.sync_bucket_mb <= 0:
            p.append(f"sync_bucket_mb={self.sync_bucket_mb}: must be > 0")
        if self.engine not in ("hf", "vllm", "vllm_server", "replay"):
            p.append(
                f"engine={self.engine!r}: must be one of 'hf', 'vllm', 'vllm_server', 'replay'"
            )
        if not is_int(self.max_off_policy_steps) or self.max_off_policy_steps < 0:
            p.append(
                f"max_off_policy_steps={self.max_off_policy_steps!r}: must be an integer >= 0 (0 = synchronous)"
            )
        elif self.max_off_policy_steps and self.engine != "vllm_server":
            p.append(
                f"max_off_policy_steps={self.max_off_policy_steps} with engine={self.engine!r}: async rollouts "
                "need the sampler in another process, where it runs while this one updates; set engine: "
                "vllm_server, or max_off_policy_steps: 0"
            )
        if self.certificate is not None and self.engine not in ("hf", "vllm"):
            p.append(
                f"certificate with engine={self.engine!r}: only engines hf and vllm return their whole "
                "next-token distribution; use one of them, or leave rollout.certificate out"
            )
        if (
            self.server is not None
            and self.server.cache_salt
            and self.engine != "vllm_server"
        ):
            p.append(
                f"server.cache_salt=True with engine={self.engine!r}: only the vllm_server engine salts its "
                "requests by weight version; set engine: vllm_server, or leave server.cache_salt false (the "
                "other engines reset their prefix cache at every sync)"
            )
        p += self._inflight_problems()
        if self.engine == "replay" and not self.replay_path:
            p.append(
                "replay_path=None: engine=replay needs a JSONL file of recorded rollouts"
            )
        return p

    def _inflight_problems(self) -> list[str]:
        """``server.inflight_updates`` pauses a ``vllm serve`` mid-batch: only that engine, only with batches in flight."""
        if self.server is None or not self.server.inflight_updates:
            return []
        if self.engine != "vllm_server":
            return [
                f"server.inflight_updates=True with engine={self.engine!r}: an engine in this process samples "
                "nothing while the trainer syncs, so there is no request to keep across a sync; set engine: "
                "vllm_server (with max_off_policy_steps >= 1), or leave server.inflight_updates false"
            ]
        if not self.max_off_policy_steps:
            return [
                "server.inflight_updates=True with max_off_policy_steps=0: generation and update take turns, so "
                "nothing is in flight at a sync; set max_off_policy_steps: 1 (async rollouts), or leave "
                "server.inflight_updates false"
            ]
        return []
