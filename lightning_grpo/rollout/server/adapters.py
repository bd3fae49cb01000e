"""LoRA adapter-only sync into ``vllm serve``: each collected batch's adapter through ``/v1/load_lora_adapter``.

A LoRA policy with ``policy.lora.sync: adapter`` on ``rollout.engine: vllm_server`` moves just the adapter (a few MB)
per collected batch instead of every merged weight. Each publication is written to a folder in memory (tmpfs) and
loaded under a new name (``policy-<n>``), every request then names it as its model, and the previous name is
unloaded: vLLM keys prefix-cache blocks by adapter id, so no block computed with an older adapter is reused. A
launched server gets ``--enable-lora`` and the runtime-loading switch (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); a
server at a URL must have been started with both. The folder path travels, not the bytes, so the servers must share
this machine's filesystem (the same node, as the ``shm`` weight transport).
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from lightning_grpo.lora import write_adapter_folder
from lightning_grpo.rollout.adapter_sync import served_rank
from lightning_grpo.rollout.server.client import ServerClient, each
from lightning_grpo.rollout.server.http_json import ServerError


class ServerAdapters:
    """The one adapter the servers serve: ``publish`` loads the next one everywhere, ``name`` is what requests use.

    Args:
        rank: the policy's LoRA rank (the servers are launched with the smallest ``--max-lora-rank`` above it).
    """

    def __init__(self, rank: int) -> None:
        self.max_rank = served_rank(rank)
        shm = Path("/dev/shm")
        self.root = Path(
            tempfile.mkdtemp(
                prefix="lightning-grpo-server-lora-", dir=shm if shm.is_dir() else None
            )
        )
        # at exit too: a failed run's
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, True)
        self.published = 0
        self.name: str | None = None
        """The adapter requests name as their model (None before the first publication: the base model)."""

    def launch_args(self) -> list[str]:
        return [
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_rank),
            "--max-loras",
            "1",
        ]

    def publish(
        self,
        clients: Sequence[ServerClient],
        tensors: dict[str, Tensor],
        config_json: str,
        leads: bool = True,
    ) -> None:
        """Load this adapter (peft format) on every server under the next name, then unload the previous one.
        ``leads=False`` (a trainer rank other than 0): only the name moves on; rank 0 loads it."""
        self.published += 1
        name = f"policy-{self.published}"
        old = self.name
        if leads:
            folder = write_adapter_folder(tensors, config_json, self.root / name)
            each(clients, functools.partial(_load, name=name, folder=folder))
            if old is not None:
                each(clients, functools.partial(_unload, name=old))
                shutil.rmtree(self.root / old, ignore_errors=True)
        self.name = name

    def close(self) -> None:
        self._cleanup()


def _load(client: ServerClient, name: str, folder: Path) -> None:
    """Load the adapter in ``folder`` under ``name``."""
    body = {"lora_name": name, "lora_path": str(folder)}
    client.post("/v1/load_lora_adapter", body, "load_lora_adapter")


def _unload(client: ServerClient, name: str) -> None:
    """Unload ``name``; a server that does not hold it (restarted since it was loaded) has nothing to unload."""
    try:
        client.post(
            "/v1/unload_lora_adapter", {"lora_name": name}, "unload_lora_adapter"
        )
    except ServerError as err:
        if "answered HTTP 404" not in str(err):
            raise
