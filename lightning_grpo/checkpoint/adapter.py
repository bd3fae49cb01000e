"""A LoRA run's checkpoints hold the adapter, not the frozen base (docs/lora.md).

``GRPOModule.on_save_checkpoint`` calls ``save_adapter``, which takes the frozen tensors out of
``checkpoint["state_dict"]`` and records a fingerprint of the base beside the adapter's config;
``on_load_checkpoint`` calls ``load_adapter``, which puts this policy's base back after checking it is the
same one. ``export_adapter`` writes the adapter of any such checkpoint as a peft folder
(``PeftModel.from_pretrained``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from lightning_grpo.lora import (
    BaseFingerprint,
    adapter_config_json,
    adapter_names,
    is_lora,
    write_adapter_folder,
)

CHECKPOINT_KEY = "grpo_lora"


def save_adapter(
    checkpoint: dict, policy: nn.Module, base: BaseFingerprint | None, prefix: str
) -> None:
    """A LoRA policy's checkpoint holds the adapter only (``drop_base``); any other checkpoint is left as it is, as is
    one written without weights (``state_dict`` refused on the way out of a failure).

    Args:
        checkpoint: the dict Lightning is about to write.
        policy: the trained policy (a peft model under ``policy.lora``).
        base: the fingerprint of its frozen base (``lora.fingerprint``).
        prefix: the policy's key prefix in the module's state dict (``"policy."``).
    """
    if "state_dict" in checkpoint and is_lora(policy):
        drop_base(checkpoint, base, prefix, policy)


def load_adapter(
    checkpoint: dict, policy: nn.Module, base: BaseFingerprint | None, prefix: str
) -> None:
    """Before Lightning loads ``checkpoint["state_dict"]`` into a LoRA policy, its frozen base goes back in
    (``restore_base``: the base is this policy's, after checking it is the one the adapter was trained on)."""
    if is_lora(policy):
        restore_base(checkpoint, policy.state_dict(prefix=prefix), base, prefix)


def drop_base(
    checkpoint: dict, base: BaseFingerprint, prefix: str, model: nn.Module
) -> None:
    """Take the frozen base out of ``checkpoint["state_dict"]`` (it is rebuilt from ``policy.path``) and record what
    it was, plus the adapter config, so the adapter can be exported from the checkpoint alone."""
    state = checkpoint["state_dict"]
    for name in base.names:
        state.pop(prefix + name, None)
    checkpoint[CHECKPOINT_KEY] = {
        "base_tensors": base.tensors,
        "base_elements": base.elements,
        "base_checksum": base.checksum,
        "prefix": prefix,
        "adapter_config": adapter_config_json(model),
        "adapter_names": adapter_names(model),
    }


def restore_base(
    checkpoint: dict, own_state: dict[str, Tensor], base: BaseFingerprint, prefix: str
) -> None:
    """Put this policy's frozen base back into a checkpoint written by ``drop_base``, after checking it is the
    base the adapter was trained on."""
    saved = checkpoint.get(CHECKPOINT_KEY)
    if saved is None:
        # a full checkpoint (written without LoRA, or by another tool): loaded as it is
        return
    same = (saved["base_tensors"], saved["base_elements"]) == (
        base.tensors,
        base.elements,
    )
    if not same or not math.isclose(
        saved["base_checksum"], base.checksum, rel_tol=1e-9, abs_tol=1e-6
    ):
        raise ValueError(
            "this checkpoint's LoRA adapter was trained on another base model: its base had "
            f"{saved['base_tensors']} frozen tensors ({saved['base_elements']} elements, checksum "
            f"{saved['base_checksum']:.6g}), this policy's has {base.tensors} ({base.elements}, {base.checksum:.6g}). "
            "Fix: set policy.path (and revision, dtype) to the base the run was started with"
        )
    state = checkpoint["state_dict"]
    for name in base.names:
        state.setdefault(prefix + name, own_state[prefix + name])


def export_adapter(
    checkpoint_path: str | os.PathLike, folder: str | os.PathLike
) -> Path:
    """Write the adapter held by a LoRA run's Lightning checkpoint (any writer) as a peft folder
    (``PeftModel.from_pretrained(base, folder)``). Loads with ``weights_only=True``."""
    ckpt = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    saved = ckpt.get(CHECKPOINT_KEY)
    if saved is None:
        raise ValueError(
            f"{checkpoint_path}: not a checkpoint of a LoRA run (no {CHECKPOINT_KEY!r} entry)"
        )
    prefix = saved["prefix"]
    state = ckpt["state_dict"]
    adapter = {
        key: state[prefix + name].contiguous()
        for name, key in saved["adapter_names"].items()
    }
    return write_adapter_folder(adapter, saved["adapter_config"], folder)
