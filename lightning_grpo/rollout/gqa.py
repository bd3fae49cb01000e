"""Grouped-query attention that reads each KV head in place while the transformers engine decodes.

A grouped-query policy (``num_key_value_heads < num_attention_heads``) keeps one key/value head per group of query
heads. transformers' ``sdpa`` attention hands the grouping to SDPA (``enable_gqa``) only when there is no attention
mask; with one (left-padded prompts: every decode step of a batched draw) it first copies every KV head once per query
head of its group (``repeat_kv``), the whole KV cache of every layer, at every decode step. On CPU torch's SDPA takes
the mask and the grouping together (its flash kernel indexes the KV head per query head) and returns the same output
bit for bit, so decoding with ``decode_attention`` skips those copies: bench/generation.py measures the draw with and
without it, and tests/rollout/test_rollout_hf.py checks the tokens and sampler logprobs are unchanged.

Generation only: the update keeps the model's own attention (SDPA's grouped backward sums the KV-head gradients in
another order, a rounding-level change to every update). Not on CUDA: there a masked grouped SDPA falls back to the
math kernel, which is why transformers copies.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

ATTENTION = "lightning_grpo_sdpa_gqa"
"""The attention implementation registered with transformers for decoding (``_grouped_sdpa``)."""


def _grouped_sdpa(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' ``sdpa`` attention, except that a masked call on grouped KV heads goes to SDPA as is
    (``enable_gqa``). Anything else (no mask, no grouping, a position bias or paged cache) is transformers' own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if (
        attention_mask is None
        or not grouped
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache")
    ):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            **kwargs,
        )
    # With a mask transformers' path is never causal-flagged and never crops the keys: the same call, minus the copies.
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Register ``ATTENTION`` (idempotent), with ``sdpa``'s mask function: decoding needs the padding mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _grouped_sdpa)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def applies(model: nn.Module) -> bool:
    """Whether ``model`` decodes faster with ``ATTENTION``: a text-only transformers model on ``sdpa`` with grouped KV
    heads, on CPU."""
    config = getattr(model, "config", None)
    if (
        config is None
        or getattr(config, "sub_configs", None)
        or getattr(config, "_attn_implementation", None) != "sdpa"
    ):
        return False
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    if not heads or not kv_heads or kv_heads >= heads:
        return False
    return next(model.parameters()).device.type == "cpu"


@contextmanager
def decode_attention(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Run the model's attention as ``ATTENTION`` inside the block where it ``applies``; its own again after."""
    if not (enabled and applies(model)):
        yield
        return
    register_attention()
    # transformers' public switch (it validates the name and reaches every sub-model)
    model.set_attn_implementation(ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation("sdpa")
