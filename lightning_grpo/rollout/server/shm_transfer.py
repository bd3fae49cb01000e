"""``lightning_grpo_shm``: a CPU weight-transfer backend for ``vllm serve``, registered through vLLM's plugin entry point.

vLLM 0.32's RL API (``/start_weight_update`` -> ``/update_weights`` x N -> ``/finish_weight_update``, served under
``VLLM_SERVER_DEV_MODE=1``) hands each ``update_info`` to the worker's ``WeightTransferEngine``. Every built-in
backend (nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n) moves CUDA tensors; this one moves a bucket as a safetensors
blob, either a file the trainer wrote to shared memory (``/dev/shm``, same node: ``{"path": ...}``) or the bytes
themselves, base64 in the request body (any node: ``{"data": ...}``). The worker loads it with the same layerwise
reload vLLM's IPC backend uses, so fused layers (q/k/v, gate/up) are rebuilt only once all their inputs arrived.

Registration: the ``vllm.general_plugins`` entry point
``lightning_grpo_shm = lightning_grpo.rollout.server.shm_transfer:register`` (``pyproject.toml``), which vLLM runs in
every process it starts (API server, engine core, workers).
The server then needs ``--weight-transfer-config '{"backend": "lightning_grpo_shm"}'``.
This module imports vLLM; only the server side (and ``register``) ever loads it.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

from lightning_grpo.rollout.server_config import BACKEND


def register() -> None:
    """vLLM general-plugin entry point: add the backend to ``WeightTransferEngineFactory`` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # vLLM runs general plugins once per process it starts
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, __name__, "ShmWeightTransferEngine"
        )


def _engine_base():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


@dataclass
class ShmInitInfo:
    """Nothing to rendezvous: the data plane is a file or the request body."""


@dataclass
class ShmUpdateInfo:
    """One bucket: a safetensors file on this node (``path``) or its bytes, base64 (``data``)."""

    path: str | None = None
    data: str | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.data is None):
            raise ValueError(
                f"{BACKEND} update_info: give exactly one of 'path' (a safetensors file on the server's "
                "node) or 'data' (its bytes, base64)"
            )


class ShmWeightTransferEngine(_engine_base()):
    """Worker side: each ``update_weights`` loads one safetensors bucket into the model (layerwise reload)."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        pass  # no rendezvous: every bucket names its own source

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(): nothing is asynchronous on CPU.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        from safetensors.torch import load, load_file

        if update_info.path is not None:
            tensors = load_file(update_info.path)  # a tmpfs file: one copy, from memory
        else:
            tensors = load(base64.b64decode(update_info.data))
        self.model.load_weights(list(tensors.items()))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_cpu_embeddings(self.model)

    def shutdown(self) -> None:
        pass


def repack_cpu_embeddings(model) -> int:
    """On CPU, vLLM 0.32 packs the LM head's weight into a GEMM handle when loading; a tied head
    (``tie_word_embeddings``) is never reloaded itself, so after a reload its packed copy still holds the old
    embedding. Re-packing every embedding-backed head fixes it (a no-op on GPU). Returns how many were re-packed."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
    )
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0  # GPU heads read layer.weight directly
    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod) and hasattr(
            module, "cpu_linear"
        ):
            method.process_weights_after_loading(module)
            count += 1
    return count
