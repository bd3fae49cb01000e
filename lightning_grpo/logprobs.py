"""Per-token logprobs of a causal LM at the positions that count, fused and memory-bounded.

The decoder runs over the whole sequence, but only the hidden states at the scored positions
(the completion tokens; prompt positions get no logits) go through the LM head, in chunks of
tokens, inside one autograd function (``fused_head.py``): no ``[B, T, V]`` tensor exists at any
point, and memory decides, by size, where the head is recomputed in backward. Entropy of the policy
at the same positions comes from the same chunk pass on request.

Equal to the plain path (``log_softmax(model(x).logits / T)`` gathered) in value and gradient,
including the head weight's gradient when it is tied to the input embedding (autograd sums both
uses). Models that transform logits after the head (softcapping, a logit scale) are scored
through their own forward instead (full logits), so their logprobs stay right.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_grpo.fused_head import CHUNK_BYTES, KEEP_BYTES, head_logprobs
from lightning_grpo.packing import PackingError, pack, packed_attention

# Config fields of models that change the logits after the LM head (Gemma 2/3, Cohere, Granite, Falcon-H1, ...).
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "lm_head_multiplier",
    "output_multiplier_scale",
)


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    positions: Tensor | None = None,
    temperature: float = 1.0,
    chunk_bytes: int = CHUNK_BYTES,
    keep_bytes: int = KEEP_BYTES,
    model_inputs: dict | None = None,
    entropy: str | None = None,
    packed: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``log p(input_ids[:, t+1] | input_ids[:, :t+1])`` at the scored positions: ``[B, T-1]``, zeros elsewhere.

    Args:
        model: a Hugging Face causal LM (``get_decoder()`` + a linear ``get_output_embeddings()``); any other
            module whose call returns ``.logits`` is scored from its full logits.
        input_ids: ``[B, T]`` right-padded sequences.
        attention_mask: ``[B, T]``, passed to the model when given.
        positions: ``[B, T-1]`` bool, True where the target ``input_ids[:, t+1]`` counts (the completion mask
            shifted by one); None = every position. Unscored positions get no logits and read 0.
        temperature: divide the logits by this (the sampler's temperature, so ratios compare like with like).
        chunk_bytes: float32 logits per head chunk (sets the chunk's token count from the vocabulary size).
        keep_bytes: float32 logits kept from forward to backward in all; chunks past it recompute the head.
        model_inputs: extra inputs of a vision-language model (pixels, image grids). The hidden states then come
            from the whole base model (vision tower + language model, ``model.base_model``, which merges the image
            features into the sequence); the LM head is still applied fused, to the scored positions only.
        entropy: None = logprobs only; ``"value"`` = also the policy's entropy at the scored positions (same
            temperature, no gradient); ``"grad"`` = the entropy with its gradient (an entropy bonus).
        packed: run the decoder padding-free (``packing.py``: the rows' real tokens as one sequence, attention within
            each row); the caller checked ``packing_problem``. Same values as padded, to rounding.

    Returns:
        float32 logprobs (float64 for a float64 model); differentiable w.r.t. the model's parameters. With
        ``entropy``: ``(logprobs, entropy)``, both ``[B, T-1]``, zeros at unscored positions.
    """
    if positions is None:
        positions = torch.ones_like(input_ids[:, 1:], dtype=torch.bool)  # [B, T-1]
    extra = model_inputs or {}
    head = _linear_head(model)
    if packed and (head is None or extra):
        raise _unpackable(model)
    if head is None:
        return _from_full_logits(
            model, input_ids, attention_mask, positions, extra, temperature, entropy
        )
    # [N, H]
    h = _scored_hidden(model, input_ids, attention_mask, positions, extra, packed)
    picked = head_logprobs(
        h,
        head.weight,
        head.bias,
        input_ids[:, 1:][positions],
        temperature=temperature,
        chunk_bytes=chunk_bytes,
        keep_bytes=keep_bytes,
        entropy=entropy,
    )
    return _scattered(picked, positions)


def _unpackable(model: nn.Module) -> PackingError:
    """Why ``model`` cannot run packed (the caller checked ``packing_problem``; this is the last guard)."""
    return PackingError(
        f"{type(model).__name__}: a packed forward needs a text-only model scored through the fused "
        "head (no images, no logit transform after the head); set rl.packed=false"
    )


def _from_full_logits(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    positions: Tensor,
    extra: dict,
    temperature: float,
    entropy: str | None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``token_logprobs`` through the model's own forward: its full logits (no plain linear head to fuse)."""
    targets = input_ids[:, 1:]  # [B, T-1]
    # [N,V]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits[
        :, :-1
    ][positions]
    picked = _plain_logprobs(logits, targets[positions], temperature)
    if entropy is None:
        return _scatter(picked, positions)
    ent = _plain_entropy(logits, temperature)
    return _scatter(picked, positions), _scatter(
        ent if entropy == "grad" else ent.detach(), positions
    )


def _scored_hidden(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    positions: Tensor,
    extra: dict,
    packed: bool,
) -> Tensor:
    """``[N, H]`` the decoder's last hidden states at the scored positions, in ``[B, T-1]`` row-major order."""
    if packed:
        rows = pack(input_ids, attention_mask)
        with packed_attention(model):
            # [1, R, H]: real tokens only
            hidden = model.get_decoder()(**rows.model_kwargs()).last_hidden_state
        return rows.gather(hidden, positions)
    decoder = _vision_language_base(model) if extra else model.get_decoder()
    # [B, T, H]
    hidden = decoder(
        input_ids=input_ids, attention_mask=attention_mask, **extra
    ).last_hidden_state
    return hidden[:, :-1][positions]  # only the scored positions meet the head


def _plain_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    if logits.dtype in (torch.float16, torch.bfloat16):
        # logsumexp in half precision loses the ratio's precision
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def _plain_entropy(logits: Tensor, temperature: float) -> Tensor:
    """``[N]`` entropy of ``softmax(logits / T)``, differentiable (the plain path's counterpart of ``_chunk_forward``)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = logits.log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def _scatter(values: Tensor, positions: Tensor) -> Tensor:
    """``[N]`` values back to their ``[B, T-1]`` positions (differentiable), zeros elsewhere."""
    return values.new_zeros(positions.shape).masked_scatter(positions, values)


def _scattered(
    picked: Tensor | tuple[Tensor, Tensor], positions: Tensor
) -> Tensor | tuple[Tensor, Tensor]:
    """``head_logprobs``' ``[N]`` logprobs (and entropy, when it returns both) back to ``[B, T-1]``."""
    if isinstance(picked, tuple):
        return _scatter(picked[0], positions), _scatter(picked[1], positions)
    return _scatter(picked, positions)


def _vision_language_base(model: nn.Module) -> nn.Module:
    """A VLM's base model (vision tower + language model; it puts the image features in place of the placeholders and
    returns hidden states). Its ``get_decoder()`` is the language model alone. Under peft, ``model.base_model`` is
    the LoRA wrapper, whose call returns logits: the transformers model sits under ``get_base_model()``."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.base_model


def fuses_head(model: nn.Module) -> bool:
    """Whether ``token_logprobs`` scores ``model`` through the fused head (else from its own full logits)."""
    return _linear_head(model) is not None


def _linear_head(model: nn.Module) -> nn.Module | None:
    """The model's LM head when the fused path reproduces its logits exactly (a plain linear layer), else None."""
    if not (hasattr(model, "get_decoder") and hasattr(model, "get_output_embeddings")):
        return None
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or model.get_decoder() is None:
        return None
    config = getattr(model, "config", None)
    if any(
        getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS
    ):
        # the model changes its logits after the head: score through its own forward
        return None
    return head
