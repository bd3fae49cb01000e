"""Per-token logprobs of a causal LM, without a full ``[B, T, V]`` float32 tensor alive.

The LM head runs over slices of the sequence; under autograd each slice is checkpointed,
so backward keeps only the hidden states ``[B, T, H]`` and recomputes one slice of logits
at a time. With a 32k+ vocabulary and long completions the logits dominate update memory,
so this is what lets micro-batching (and long completions) fit.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def _slice_logprobs(head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float) -> Tensor:
    logits = head(hidden)  # [B, S, V]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # logsumexp in half precision loses the ratio's precision
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, S]
    return picked - logits.logsumexp(-1)


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    slice_tokens: int = 128,
) -> Tensor:
    """``log p(input_ids[:, t+1] | input_ids[:, :t+1])`` for every position: ``[B, T-1]`` (fp32 or wider).

    Args:
        model: a Hugging Face causal LM (``get_decoder()`` + ``get_output_embeddings()``), or any
            module whose call returns ``.logits`` (then the full logits are materialized).
        input_ids: ``[B, T]`` right-padded sequences.
        attention_mask: ``[B, T]``; padding sits after the real tokens, so it only matters for models
            with non-causal parts. Passed through when given.
        temperature: divide logits by this (match the sampler's temperature for rollout logprobs).
        slice_tokens: sequence positions per LM-head slice; smaller = less peak memory.
    """
    targets = input_ids[:, 1:]  # [B, T-1]
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or head is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        return _slice_logprobs(nn.Identity(), logits, targets, temperature)
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]  # [B, T-1, H]
    out = []
    for start in range(0, hidden.shape[1], slice_tokens):
        h, t = hidden[:, start : start + slice_tokens], targets[:, start : start + slice_tokens]
        if torch.is_grad_enabled():
            # Recompute this slice's logits in backward instead of keeping [B, S, V] per slice alive.
            out.append(checkpoint(_slice_logprobs, head, h, t, temperature, use_reentrant=False))
        else:
            out.append(_slice_logprobs(head, h, t, temperature))
    return torch.cat(out, dim=1)
