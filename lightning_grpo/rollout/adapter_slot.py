"""The one LoRA adapter the in-process vLLM engine serves (``VLLMEngine`` built with ``lora_rank``).

Each publication is a folder in memory (tmpfs where there is one) loaded as a new ``LoRARequest``; the
server engine has its own (``server/adapters.py``), since a server reads folders by path over HTTP.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

from torch import Tensor

from lightning_grpo.lora import write_adapter_folder
from lightning_grpo.rollout.adapter_sync import served_rank


class AdapterSlot:
    """The one LoRA adapter an engine serves: each publication is written to a folder in memory (tmpfs where
    there is one) and added as a new ``LoRARequest`` id, then the previous one is removed. A new id per
    collected batch also keeps prefix-cache blocks of an older adapter from being reused (vLLM keys them by id)."""

    def __init__(self, rank: int) -> None:
        self.max_rank = served_rank(rank)
        shm = Path("/dev/shm")
        self.root = Path(
            tempfile.mkdtemp(
                prefix="lightning-grpo-lora-", dir=shm if shm.is_dir() else None
            )
        )
        # gone with the slot, or at exit: an engine nobody closes (a CLI fit's) would leave it in RAM until reboot
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, True)
        self.request = None  # the LoRARequest generation uses
        self.published = 0

    def engine_kwargs(self) -> dict:
        return {"enable_lora": True, "max_lora_rank": self.max_rank, "max_loras": 1}

    def publish(self, llm_engine, tensors: dict[str, Tensor], config_json: str) -> None:
        from vllm.lora.request import LoRARequest

        self.published += 1
        folder = write_adapter_folder(
            tensors, config_json, self.root / f"adapter-{self.published}"
        )
        request = LoRARequest(f"policy-{self.published}", self.published, str(folder))
        if not llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM refused LoRA adapter {folder}")
        old = self.request
        self.request = request
        if old is not None:
            llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def close(self) -> None:
        self._cleanup()
