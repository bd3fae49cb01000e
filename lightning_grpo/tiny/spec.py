"""``TinyPolicySpec``: the shape of a locally built tiny policy (``policy.tiny`` in a config).

A plain dataclass with no torch and no import of ours but the dependency-free ``checks.py`` (its validation):
``PolicyConfig`` names it as the type of its ``tiny`` field, and the CLI parses it, without loading the builder
(``build.py``) or the warm starts (``warm.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_grpo.checks import is_finite, is_int, raise_problems

TINY_NAMES = (
    "default",
    "quickstart",
    "tools",
    "vlm-quickstart",
    "dpo",
    "opd-student",
    "opd-teacher",
    "teacher",
)
"""The ``tiny:<name>`` policies the shipped configs and docs name (each the default shape unless its config gives one).
Any other name labels a new shape in the cache, so it needs that shape under ``policy.tiny``: a typo is refused."""


@dataclass
class TinyPolicySpec:
    """Shape of a locally built policy. head_dim >= 32 so vLLM's CPU attention accepts it."""

    arch: Literal[
        "qwen2", "llama", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen2_5_vl"
    ] = "qwen2"
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

    def __post_init__(self) -> None:
        raise_problems("policy.tiny config", self.problems())

    def problems(self) -> list[str]:
        """Every broken rule as a ``field=value: rule; fix`` line (shapes transformers would refuse later)."""
        p = [
            f"{name}={getattr(self, name)!r}: must be an integer >= 1"
            for name in (
                "hidden_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "intermediate_size",
                "max_position_embeddings",
                "num_experts",
                "experts_per_token",
            )
            if not is_int(getattr(self, name)) or getattr(self, name) < 1
        ]
        if not p and self.hidden_size % self.num_heads:
            p.append(
                f"hidden_size={self.hidden_size}: must divide by num_heads={self.num_heads} (head_dim)"
            )
        if not p and self.num_heads % self.num_kv_heads:
            p.append(
                f"num_kv_heads={self.num_kv_heads}: must divide num_heads={self.num_heads}"
            )
        if not p and self.experts_per_token > self.num_experts:
            p.append(
                f"experts_per_token={self.experts_per_token}: must not exceed num_experts={self.num_experts}"
            )
        if self.vocab_size is not None and (
            not is_int(self.vocab_size) or self.vocab_size < 1
        ):
            p.append(
                f"vocab_size={self.vocab_size!r}: must be a positive integer or null (the tokenizer's size)"
            )
        if not is_finite(self.dropout) or not 0 <= self.dropout < 1:
            p.append(f"dropout={self.dropout!r}: must be in [0, 1)")
        if not is_finite(self.router_jitter) or self.router_jitter < 0:
            p.append(
                f"router_jitter={self.router_jitter!r}: must be a finite number >= 0 (0 = off)"
            )
        if not is_finite(self.init_std) or self.init_std <= 0:
            p.append(f"init_std={self.init_std!r}: must be a finite number > 0")
        return p
