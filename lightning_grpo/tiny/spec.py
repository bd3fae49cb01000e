"""``TinyPolicySpec``: the shape of a locally built tiny policy (``policy.tiny`` in a config).

A plain dataclass with no imports of ours and no torch: ``PolicyConfig`` names it as the type of its ``tiny``
field, and the CLI parses it, without loading the builder (``build.py``) or the warm starts (``warm.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class TinyPolicySpec:
    """Shape of a locally built policy. head_dim >= 32 so vLLM's CPU attention accepts it."""

    arch: Literal["qwen2", "llama", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen2_5_vl"] = "qwen2"
    """Transformers architecture of the built model; the ``*moe``/mixtral ones are sparse MoE (see docs/moe.md);
    ``qwen2_5_vl`` = a vision-language Qwen2.5-VL (a small vision tower plus this text model; ``tiny/vlm.py``) for
    image prompts."""
    hidden_size: int = 128
    """Model width."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads (head_dim = hidden_size / num_heads)."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention when fewer than num_heads)."""
    intermediate_size: int = 256
    """MLP width."""
    max_position_embeddings: int = 256
    """Context length (prompt + completion tokens)."""
    vocab_size: int | None = None
    """None = the character tokenizer's size; larger pads the embedding (e.g. 32k for benchmarks)."""
    dropout: float = 0.0
    """Attention dropout; > 0 makes train() and eval() forwards differ (the determinism probe catches it)."""
    num_experts: int = 4
    """MoE architectures only: routed experts per MoE layer."""
    experts_per_token: int = 2
    """MoE architectures only: top-k experts each token is routed to."""
    router_jitter: float = 0.0
    """Mixtral only: ``router_jitter_noise``, a train()-mode multiplicative noise on the MoE input (routing churn)."""
    init_std: float = 0.02
    """Std of the random initialization (``initializer_range``); larger gives a sharper, routing-sensitive model."""
    seed: int | None = None
    """Seed of the random initialization and the warm start; None = the module's seed (``model.seed``, else
    ``seed_everything``), 0 outside a module. Part of the cache key, as every field here."""
    chat_template: bool = False
    """Give the char tokenizer ``TINY_CHAT_TEMPLATE`` (a plain-text chat format), so chat-message prompts work."""
