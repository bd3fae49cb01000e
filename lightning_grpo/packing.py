"""Padding-free packed forwards: the rows of a chunk as one sequence, attention that never crosses a row.

A padded chunk is ``[B, T]`` with every row right-padded to the chunk's longest; its forward pays ``B x T`` tokens
in every linear layer. Packed, the chunk's real tokens are laid row after row into ``[1, R]`` (``R`` = real tokens),
with position ids restarting at 0 on each row, and attention runs row by row: ``torch``'s
``scaled_dot_product_attention`` with ``is_causal=True`` on each row's own slice of the queries, keys and values
(``_row_attention``). Row ``b``'s token ``t`` then sees exactly what it sees padded (its own tokens ``<= t``,
position ``t``), so logprobs and gradients equal the padded path's to rounding (tests/test_packing.py).

Why per-row SDPA and not transformers' own packed path (``attention_mask=None`` + restarting ``position_ids``,
which builds a block-diagonal ``[R, R]`` mask for sdpa/eager): a dense mask over the packed sequence costs
``R^2`` scores per head instead of ``sum(len_b^2)``, which on a long-tail chunk is more than the padding saved
(bench/packing.py measures both). ``flex_attention`` needs ``torch.compile`` on CPU (minutes of compile per new
shape on a laptop, no gain at these sizes); a GPU varlen kernel (flash-attention's ``cu_seq_lens``) is the natural
next backend and takes the same ``cu_seq_lens_q`` this module passes.

The packed forward swaps the model's attention implementation for ``ATTENTION`` only for its own duration
(``packed_attention``); generation and every padded forward keep the model's own. ``ATTENTION`` refuses a call that
carries no row boundaries, so a model path that loses them fails loudly instead of attending across rows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)
ATTENTION = "lightning_grpo_rows"
"""The attention implementation registered with transformers for packed forwards (``_row_attention``)."""
EXACT_ATTENTION = ("sdpa", "eager")
"""Attention implementations whose padded forward the per-row SDPA reproduces (plain causal softmax attention)."""
# Config fields that make attention something other than plain causal softmax attention over the whole row.
_ATTENTION_CHANGES = (
    "attn_logit_softcapping",
    "sliding_window",
    "attention_chunk_size",
    "layer_types",
)


class PackingError(ValueError):
    """The policy cannot take a packed forward exactly (``packing_problem`` says why)."""


@dataclass(frozen=True)
class Packed:
    """A right-padded ``[B, T]`` chunk laid out padding-free.

    Attributes:
        input_ids: ``[1, R]`` every row's real tokens, row after row.
        position_ids: ``[1, R]`` each token's position in its own row (restarts at 0).
        cu_seq_lens: ``[B + 1]`` int32 row boundaries in the packed sequence (flash-attention's varlen layout).
        offsets: ``[B]`` int64 where each row starts (``cu_seq_lens[:-1]``).
        max_length: the longest row.
    """

    input_ids: Tensor
    position_ids: Tensor
    cu_seq_lens: Tensor
    offsets: Tensor
    max_length: int

    @property
    def lengths(self) -> Tensor:
        """``[B]`` real tokens per row."""
        return (self.cu_seq_lens[1:] - self.cu_seq_lens[:-1]).long()

    def model_kwargs(self) -> dict:
        """The forward's keyword arguments: no attention mask (the boundaries are the mask), per-row positions, and
        the boundaries under transformers' varlen names (the model passes them to its attention function)."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": None,
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
        }

    def gather(self, hidden: Tensor, positions: Tensor) -> Tensor:
        """``[N, H]`` packed hidden states ``[1, R, H]`` at the padded layout's scored positions ``[B, T']`` (True at
        ``(b, t)`` picks row ``b``'s token ``t``), in the padded layout's row-major order."""
        width = positions.shape[1]
        steps = torch.arange(width, device=positions.device)
        # would read the next row's tokens
        if (positions & (steps[None, :] >= self.lengths[:, None])).any():
            raise PackingError(
                "a scored position lies in a row's padding: packing cannot place it"
            )
        index = self.offsets[:, None] + steps  # [B, T']
        return hidden[0, index[positions]]


def pack(input_ids: Tensor, attention_mask: Tensor) -> Packed:
    """Pack a right-padded chunk (each row's real tokens a prefix, as ``RolloutBatch`` lays them out)."""
    real = attention_mask.bool()
    lengths = real.sum(-1)  # [B]
    width = input_ids.shape[1]
    # [B, T]
    prefix = torch.arange(width, device=real.device)[None, :] < lengths[:, None]
    if not torch.equal(prefix, real):
        raise PackingError(
            "packing needs right-padded rows (real tokens from position 0, padding after); this chunk's "
            "attention mask has padding before a real token"
        )
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=real.device)
    cu[1:] = lengths.cumsum(0)
    positions = torch.arange(width, device=real.device).expand_as(real)[real]  # [R]
    return Packed(
        input_ids[real][None],
        positions[None],
        cu,
        cu[:-1].long(),
        int(lengths.max()) if len(lengths) else 0,
    )


def _row_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Causal attention within each packed row: ``[1, heads, R, D]`` in, ``[1, R, heads, D]`` out (transformers'
    attention-function contract). One SDPA call per row (``is_causal``, no mask): ``sum(len^2)`` scores, not ``R^2``.
    The boundaries come as Python ints from ``cu_seq_lens_q`` (one host copy per layer; a GPU varlen kernel would
    take the tensor as is)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        raise PackingError(
            f"{ATTENTION} attention called without packed row boundaries (cu_seq_lens_q) on a "
            f"[{query.shape[0]}, ...] batch: it would attend across rows"
        )
    bounds = cu.tolist()
    rows = [
        sdpa_attention_forward(
            module,
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            None,
            dropout=dropout,
            scaling=scaling,
            is_causal=True,
        )[0]
        for s, e in pairwise(bounds)
        if e > s
    ]
    return torch.cat(rows, dim=1), None


def register_attention() -> None:
    """Register ``ATTENTION`` with transformers (idempotent). No mask function is registered for it: the model then
    builds no ``[R, R]`` mask for a packed forward (``masking_utils`` skips implementations it does not know)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _row_attention)


@contextmanager
def packed_attention(model: nn.Module) -> Iterator[None]:
    """Run the model's attention as ``_row_attention`` inside the block, its own implementation again after."""
    config = getattr(model, "config", None)
    if config is None:
        raise PackingError(
            f"{type(model).__name__} has no transformers config: its attention cannot be switched"
        )
    register_attention()
    before = config._attn_implementation
    # transformers' public switch (it validates the name and reaches every sub-model)
    model.set_attn_implementation(ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def packing_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot take an exact packed forward, or None. Checked once at setup: a text-only transformers
    causal LM with a plain linear LM head, ``sdpa`` or ``eager`` attention, plain causal attention over each whole
    row (no sliding window, chunked attention or softcapping), and position ids it reads per token."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_decoder"):
        return f"{type(model).__name__} is not a transformers causal LM"
    implementation = config._attn_implementation
    if implementation not in EXACT_ATTENTION:
        return (
            f"attention implementation {implementation!r} cannot be checked to honour packed row boundaries "
            f"(packing reproduces {' or '.join(EXACT_ATTENTION)})"
        )
    if getattr(config, "sub_configs", None):
        return f"{config.model_type} has sub-models (a vision-language policy): its image features follow the padding"
    changed = [name for name in _ATTENTION_CHANGES if _active(config, name)]
    if changed:
        return f"{config.model_type} attention is not plain causal over each row ({', '.join(changed)})"
    return None


def _active(config, name: str) -> bool:
    value = getattr(config, name, None)
    # Qwen2 keeps a window size but only applies it with use_sliding_window
    if name == "sliding_window":
        return value is not None and getattr(config, "use_sliding_window", True)
    if name == "layer_types":
        return value is not None and any(t != "full_attention" for t in value)
    return value not in (None, 0, False)


@dataclass(frozen=True)
class Packing:
    """Whether a policy's chunks are packed (``rl.packed``), decided once at setup (``Packing.resolve``).

    ``problem``: why this policy cannot be packed exactly (None: it can). ``setting`` ``"auto"`` packs where exact and
    measured faster (CPU: bench/packing.py); ``True`` packs on any device.
    """

    setting: bool | str = False
    problem: str | None = None

    def on(self, device_type: str) -> bool:
        """Whether a chunk scored on ``device_type`` is packed."""
        if self.problem is not None or self.setting is False:
            return False
        return self.setting is True or device_type == "cpu"

    @classmethod
    def resolve(
        cls,
        setting: bool | str,
        model: nn.Module,
        vision: bool = False,
        routing: bool = False,
        linear_head: bool = True,
    ) -> Packing:
        """The policy's packing: ``True`` with a problem raises ``PackingError`` naming it; ``"auto"`` with one falls
        back to padded chunks with a one-line warning naming it."""
        if setting is False:
            return cls(False)
        problem = (
            "a vision-language policy (its image features are placed by the padded layout)"
            if vision
            else "MoE routing replay (routes are recorded per padded token)"
            if routing
            else "the model transforms its logits after the LM head (scored from full logits)"
            if not linear_head
            else packing_problem(model)
        )
        if problem is not None and setting is True:
            raise PackingError(
                f"rl.packed=true: cannot pack this policy exactly: {problem}. Set rl.packed=false "
                "(or auto: padded chunks)"
            )
        if problem is not None:
            log.warning("rl.packed=auto: padded chunks: %s", problem)
        return cls(setting, problem)


PADDED = Packing(False)
"""No packing (``rl.packed=false``): every chunk padded to its longest row."""
