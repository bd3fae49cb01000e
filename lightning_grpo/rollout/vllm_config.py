"""``VLLMConfig``: how the in-process vLLM engine is built (``rollout.vllm``; ``lightning_grpo.config`` re-exports it).

Kept beside the engines and apart from ``config.py``: a plain dataclass that imports nothing but ``checks.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lightning_grpo.checks import raise_problems


@dataclass
class VLLMConfig:
    """How the in-process vLLM engine is built."""

    gpu_memory_utilization: float = 0.5
    """Fraction of device memory vLLM may take (weights + KV cache). Colocated: leave room for the trainer."""
    tensor_parallel_size: int = 1
    """GPUs one engine shards the model over."""
    max_model_len: int | None = None
    """Context length (prompt + completion); None = the model's."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine weight dtype; weight syncs cast to it. auto = vLLM's pick (0.32 downcasts float32 checkpoints to bf16)."""
    enable_sleep_mode: bool | None = None
    """Free weights/KV cache between generations (sleep/wake_up). None = on where vLLM supports it (CUDA/ROCm/XPU)."""
    enforce_eager: bool = False
    """Skip torch.compile / CUDA graphs: faster start (seconds on CPU), slower decoding."""
    seed: int = 0
    """vLLM's seed for unseeded requests."""
    distributed_executor_backend: Literal["external_launcher"] | None = None
    """external_launcher: one engine per DDP rank, in the trainer's process group. None: a standalone engine."""
    kv_cache_memory_bytes: int | None = None
    """KV cache size in bytes; None = sized from gpu_memory_utilization. On CPU this replaces VLLM_CPU_KVCACHE_SPACE."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of shared prompt prefixes (a weight sync resets them)."""
    logprobs_mode: Literal["auto", "processed_logprobs", "raw_logprobs"] = "auto"
    """processed: log-softmax after temperature/top-k/top-p (what was sampled, as HFEngine); raw: of the plain
    logits; auto: processed when the run consumes sampler logprobs (rl.rollout_correction.mode other than off), else raw
    (vLLM then skips a full-vocabulary log-softmax per decode step)."""
    engine_kwargs: dict = field(default_factory=dict)
    """Extra ``vllm.LLM`` keyword arguments, passed through unchanged."""

    def __post_init__(self) -> None:
        raise_problems("vllm config", self.problems())

    def problems(self) -> list[str]:
        """Every broken rule as a ``field=value: rule; fix`` line."""
        p = []
        if not 0 < self.gpu_memory_utilization <= 1:
            p.append(
                f"gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]"
            )
        if self.tensor_parallel_size < 1:
            p.append(f"tensor_parallel_size={self.tensor_parallel_size}: must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            p.append(
                f"max_model_len={self.max_model_len}: must be >= 1 or None (the model's)"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            p.append(
                f"kv_cache_memory_bytes={self.kv_cache_memory_bytes}: must be >= 1 or None (auto)"
            )
        if self.logprobs_mode not in ("auto", "processed_logprobs", "raw_logprobs"):
            p.append(
                f"logprobs_mode={self.logprobs_mode!r}: must be 'auto', 'processed_logprobs' or 'raw_logprobs'"
            )
        return p
