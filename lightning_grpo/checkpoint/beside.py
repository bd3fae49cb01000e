"""What travels beside each checkpoint: the run's resolved config and, for a LoRA policy, its adapter.

Written before the checkpoint (rank 0), and removed again when the save it goes with fails.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from lightning.pytorch import Trainer

from lightning_grpo.checkpoint.atomic import atomic_write_bytes
from lightning_grpo.checkpoint.paths import adapter_path, config_path
from lightning_grpo.lora import is_lora, save_adapter


def write_beside(trainer: Trainer, path: Path) -> None:
    """The config beside the checkpoint ``path``, and the adapter in peft's format (``PeftModel.from_pretrained``)."""
    policy = getattr(trainer.lightning_module, "policy", None)
    atomic_write_bytes(config_path(path), resolved_config(trainer).encode())
    if is_lora(policy):
        save_adapter(policy, adapter_path(path))


def remove_beside(path: Path) -> None:
    """No checkpoint, no config or adapter beside it."""
    config_path(path).unlink(missing_ok=True)
    shutil.rmtree(adapter_path(path), ignore_errors=True)


def resolved_config(trainer: Trainer) -> str:
    """The run's full config as YAML: LightningCLI's parsed config, else the module's config dataclasses."""
    from lightning.pytorch.cli import SaveConfigCallback

    for cb in trainer.callbacks:
        if isinstance(cb, SaveConfigCallback):
            return cb.parser.dump(cb.config, skip_none=False)
    import yaml

    module = trainer.lightning_module
    out = {}
    for name in ("policy_cfg", "rl", "optim_cfg", "rollout_cfg", "seed"):
        value = getattr(module, name, None)
        out[name] = (
            dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        )
    return yaml.safe_dump(
        {"model": out, "trainer": {"max_steps": trainer.max_steps}}, sort_keys=False
    )
