"""Publishing a LoRA policy to a rollout engine: the adapter alone, or every weight merged.

An engine that serves adapters (``VLLMEngine`` built with ``lora_rank``) gets just the adapter each
collected batch (``load_adapter``: a new LoRA request), plus ``modules_to_save`` as plain weights
(vLLM 0.32 takes those in an adapter only for classification heads) and, after a level-2 sleep
discarded its weights, every base tensor once. Any other engine gets ``W + scale * B @ A`` through
the ordinary bucketed sync.

Names: peft prefixes every tensor (``base_model.model.``), moves a wrapped layer's weight under
``base_layer`` and adds ``lora_A``/``lora_B``. ``engine_weights`` turns that back into the checkpoint
names the engine loaded. The merged tensors are computed as the sync reaches them, so the trainer's
base weights are never merged and unmerged in place (a round trip that drifts them every step).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from lightning_grpo.checks import ConfigError
from lightning_grpo.lora import (
    ADAPTER_NAME,
    adapter_config_json,
    adapter_state_dict,
    is_lora,
)
from lightning_grpo.rollout.base import LoadsAdapters, RolloutEngine
from lightning_grpo.rollout.weight_sync import SyncStats, named_weights, push_weights

NamedTensors = Iterable[tuple[str, Tensor]]


def engine_weights(
    model: nn.Module, merged: bool, modules_to_save_only: bool = False
) -> Iterator[tuple[str, Tensor]]:
    """The policy under the checkpoint names an engine loaded, each tensor computed when the sync reaches it.

    ``merged``: every adapted weight is ``W + scale * B @ A`` (for an engine without adapters); else the base ``W``
    (an engine that serves the adapter itself). Modules in ``modules_to_save`` come as trained either way;
    ``modules_to_save_only`` yields just those.
    """
    base = model.get_base_model()
    layers = {
        name: module for name, module in base.named_modules() if _has_adapter(module)
    }
    for name, tensor in named_weights(base):
        engine_name = _engine_name(name)
        if engine_name is None or (modules_to_save_only and _TRAINED not in name):
            continue
        owner, _, leaf = name.rpartition(".")
        layer = (
            layers.get(owner.removesuffix(".base_layer"))
            if owner.endswith(".base_layer")
            else None
        )
        if merged and layer is not None and leaf == "weight":
            with torch.no_grad():
                tensor = tensor.detach() + layer.get_delta_weight(ADAPTER_NAME).to(
                    tensor.dtype
                )
        yield engine_name, tensor


def _has_adapter(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A


_ADAPTER_PARTS = (
    ".lora_A.",
    ".lora_B.",
    ".lora_embedding_A.",
    ".lora_embedding_B.",
    ".lora_magnitude_vector.",
)
_TRAINED = f".modules_to_save.{ADAPTER_NAME}."


def _engine_name(name: str) -> str | None:
    """peft's parameter name -> the checkpoint name (None: adapter tensors, and the base copy of a module trained
    in full, which only the KL reference uses)."""
    if any(part in name for part in _ADAPTER_PARTS) or ".original_module." in name:
        return None
    return name.replace(_TRAINED, ".").replace(".base_layer.", ".")


def served_adapter(model: nn.Module) -> tuple[dict[str, Tensor], str]:
    """(tensors, adapter_config.json) of the adapter as an engine serves it: LoRA matrices only. vLLM 0.32 takes no
    ``modules_to_save`` (but classifier heads): those are pushed as plain weights beside it."""
    tensors = {
        k: v
        for k, v in adapter_state_dict(model).items()
        if any(p in k for p in _ADAPTER_PARTS)
    }
    config = json.loads(adapter_config_json(model))
    config["modules_to_save"] = None
    return tensors, json.dumps(config, indent=2, sort_keys=True)


VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for ``max_lora_rank``."""


def served_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds a rank-``rank`` adapter; refused above its largest."""
    if rank > VLLM_RANKS[-1]:
        raise ConfigError(
            f"policy.lora.rank={rank}: vLLM serves adapters up to rank {VLLM_RANKS[-1]}; lower it or "
            "set policy.lora.sync=merge"
        )
    return next(r for r in VLLM_RANKS if r >= rank)


def serves_adapters(engine: RolloutEngine) -> bool:
    """The engine takes a LoRA adapter itself (``VLLMEngine`` or ``VLLMServerEngine`` built with ``lora_rank``)."""
    return isinstance(engine, LoadsAdapters) and engine.serves_adapters


def publish_policy(
    model: nn.Module,
    engine,
    bucket_bytes: int,
    with_base: bool = False,
    record: Callable[[NamedTensors], NamedTensors] | None = None,
) -> SyncStats:
    """Publish any policy: a LoRA one through ``push_policy``, else every parameter and persistent buffer as is."""
    if is_lora(model):
        return push_policy(
            model, engine, bucket_bytes, with_base=with_base, record=record
        )
    named = named_weights(model)
    return push_weights(
        record(named) if record else named, engine, bucket_bytes=bucket_bytes
    )


def _as_pushed(named: NamedTensors) -> NamedTensors:
    """No ``record``: the pushed stream unchanged."""
    return named


def push_policy(
    model: nn.Module,
    engine,
    bucket_bytes: int,
    with_base: bool,
    record: Callable[[NamedTensors], NamedTensors] | None = None,
) -> SyncStats:
    """Publish a LoRA policy: the adapter alone to an engine that serves adapters (plus modules_to_save as plain
    weights, and the base weights when ``with_base``: after a level-2 sleep discarded them), else every weight
    merged. ``record(named)`` wraps the pushed (name, tensor) stream. Returns the sync's ``SyncStats``."""
    record = record or _as_pushed
    if not serves_adapters(engine):
        return push_weights(
            record(engine_weights(model, merged=True)),
            engine,
            bucket_bytes=bucket_bytes,
        )
    start = time.perf_counter()
    named = list(
        engine_weights(model, merged=False, modules_to_save_only=not with_base)
    )
    pushed = (
        push_weights(record(named), engine, bucket_bytes=bucket_bytes)
        if named
        else None
    )
    tensors, config = served_adapter(model)
    engine.load_adapter(tensors, config)
    engine.reset_prefix_cache()
    adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return SyncStats(
        n_buckets=(pushed.n_buckets if pushed else 0) + 1,
        n_tensors=(pushed.n_tensors if pushed else 0) + len(tensors),
        bytes=(pushed.bytes if pushed else 0) + adapter_bytes,
        seconds=time.perf_counter() - start,
    )
