"""Weight sync: stream the trainer's named tensors into an engine in size-bounded buckets.

One ``engine.load_weights(bucket)`` call per bucket (never one per parameter: each call
has a fixed cost), then one ``engine.reset_prefix_cache()`` so no KV block computed with
the old weights is reused. Weights never go through disk.

Buckets never split a *load group*: by default all tensors of one decoder layer
(``model.layers.7.*``) travel together. vLLM fuses checkpoint tensors into one kernel
tensor (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``, experts -> ``FusedMoE``) and
its in-place reload (0.32) processes each fused layer within a single call: a layer that
receives only part of its inputs is rebuilt with uninitialized memory for the rest
(measured: wrong logprobs when q is split from k/v, NaN when pushed per parameter).
So a bucket may exceed ``bucket_bytes`` when one load group alone is larger.

Memory: at most one bucket of materialized tensors (cast, and gathered from FSDP2 shards
with ``DTensor.full_tensor()``, a collective every rank must join in the same order) is
alive at a time, plus the group being added.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_grpo.rollout.base import RolloutEngine, WeightDevice, WeightDtype

DEFAULT_BUCKET_BYTES = 256 << 20
"""256 MiB: large enough that per-call overhead vanishes, small enough to stay off the memory peak."""

NamedTensors = Iterable[tuple[str, Tensor]]
_LAYER = re.compile(r"^(.*?\.\d+)\.")


@dataclass(frozen=True)
class SyncStats:
    """What one ``push_weights`` moved."""

    n_buckets: int
    n_tensors: int
    bytes: int
    """Bytes handed to the engine, after the cast to its dtype."""
    seconds: float


def layer_group_key(name: str) -> str:
    """Load group of a tensor: its decoder layer (``model.layers.3``), else its module's parent.

    Everything under the first numbered module travels together (fused q/k/v, gate/up and
    MoE experts live there); other tensors group by the module above their own
    (``model.embed_tokens.weight`` -> ``model``).
    """
    match = _LAYER.match(name)
    return match.group(1) if match else name.rsplit(".", 2)[0]


def named_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Parameters (tied ones once) and persistent buffers: what a checkpoint of ``model`` holds."""
    yield from ((_clean(n), p) for n, p in model.named_parameters())
    for module_name, module in model.named_modules():
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf_name not in module._non_persistent_buffers_set:
                yield (
                    _clean(f"{module_name}.{buf_name}" if module_name else buf_name),
                    buf,
                )


def iter_buckets(
    named_tensors: NamedTensors,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    group_key: Callable[[str], str] | None = layer_group_key,
) -> Iterator[list[tuple[str, Tensor]]]:
    """Yield lists of ``(name, tensor)`` whose total bytes stay within ``bucket_bytes``.

    Tensors are detached, gathered if they are DTensors, cast to ``dtype`` (None = keep),
    moved to ``device`` (None = keep) and made contiguous as they enter a bucket.
    Consecutive tensors with the same ``group_key`` are never split (None = each tensor is
    its own group); a group bigger than ``bucket_bytes`` goes alone in its own bucket.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"iter_buckets(bucket_bytes={bucket_bytes}): must be > 0")
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for group in _groups(named_tensors, group_key):
        group_size = sum(_nbytes(t, dtype) for _, t in group)
        if bucket and size + group_size > bucket_bytes:
            yield bucket
            bucket = []
            size = 0
        bucket += [(name, _materialize(t, dtype, device)) for name, t in group]
        size += group_size
    if bucket:
        yield bucket


def push_weights(
    source: nn.Module | NamedTensors,
    engine: RolloutEngine,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    group_key: Callable[[str], str] | None = layer_group_key,
) -> SyncStats:
    """Load ``source`` (a module, or its named tensors) into ``engine``, then reset its prefix cache.

    ``dtype`` None = the engine's own when it has one (``WeightDtype``: vLLM), else unchanged; each bucket goes to
    the engine's device when it has one (``WeightDevice``: a server's host).
    """
    named = named_weights(source) if isinstance(source, nn.Module) else source
    if dtype is None and isinstance(engine, WeightDtype):
        dtype = engine.dtype
    device = engine.device if isinstance(engine, WeightDevice) else None
    start = time.perf_counter()
    n_buckets = n_tensors = n_bytes = 0
    for bucket in iter_buckets(named, bucket_bytes, dtype, device, group_key):
        engine.load_weights(bucket)
        n_buckets += 1
        n_tensors += len(bucket)
        n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
    engine.reset_prefix_cache()
    return SyncStats(n_buckets, n_tensors, n_bytes, time.perf_counter() - start)


def _groups(
    named_tensors: NamedTensors, group_key: Callable[[str], str] | None
) -> Iterator[list]:
    if group_key is None:
        return ([nt] for nt in named_tensors)
    return (
        list(g)
        for _, g in itertools.groupby(named_tensors, key=lambda nt: group_key(nt[0]))
    )


def _nbytes(t: Tensor, dtype: torch.dtype | None) -> int:
    """Bytes after the cast, from metadata only (a DTensor's shape is its global shape)."""
    return t.numel() * (dtype or t.dtype).itemsize


def _materialize(
    t: Tensor, dtype: torch.dtype | None, device: torch.device | str | None
) -> Tensor:
    t = t.detach()
    if _is_dtensor(t):
        # all-gather of the FSDP2 shards: collective, same order on every rank
        t = t.full_tensor()
    return t.to(device=device, dtype=dtype).contiguous()


def _is_dtensor(t: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def _clean(name: str) -> str:
    """Strip the ``torch.compile`` wrapper prefix so names match the checkpoint's."""
    return name.replace("_orig_mod.", "")
