"""LoRA policies through ``peft``: the ``policy.lora`` section, wrapping, and the adapter in peft's format.

``apply_lora`` wraps the loaded causal LM with ``peft.get_peft_model``: the base is frozen, so only the
adapter (and ``modules_to_save``) gets gradients and optimizer state. The KL reference is the same module
with its adapters disabled (``reference_mode``), never a second copy. Target modules are checked before
peft sees them: an entry that matches no module is refused with the names that exist.

Publishing to an engine: ``rollout/adapter_sync.py``; checkpoints without the frozen base:
``checkpoint/adapter.py``; docs/lora.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_grpo.checks import is_int, raise_problems

ADAPTER_NAME = "default"
ALL_LINEAR = "all-linear"


@dataclass
class LoraConfig:
    """The ``policy.lora`` section: train a LoRA adapter (peft) instead of every weight."""

    rank: int = 16
    """Rank r of each adapter (A: r x in, B: out x r)."""
    alpha: float = 32.0
    """Scaling numerator: the adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input. 0 by default: a stochastic layer makes train() and eval() forwards differ,
    which the pi_old probe refuses at n_mini > 1."""
    target_modules: list[str] | str = ALL_LINEAR
    """Modules that get an adapter: a list of names (a module matches when its name equals an entry or ends with
    '.' + entry, e.g. q_proj), a regex matched against full module names, or 'all-linear' (every linear layer but
    the output head). Every list entry must match a module (refused at setup, listing the names available)."""
    modules_to_save: list[str] | None = None
    """Modules trained in full beside the adapter (e.g. a final norm, an untied head); saved with the adapter, and
    pushed to vLLM as plain weights beside it. An embedding tied to the output head is refused."""
    sync: Literal["adapter", "merge"] = "adapter"
    """How a vLLM engine gets the policy each collected batch: 'adapter' loads just the adapter as a new LoRA
    request (engine built with enable_lora); 'merge' pushes base + adapter merged, as a full weight sync (for
    engines or layers without LoRA support)."""

    def __post_init__(self) -> None:
        raise_problems("policy.lora config", self.problems())

    def problems(self) -> list[str]:
        """Every broken rule as a ``field=value: rule; fix`` line (target names are checked at setup)."""
        p = []
        if not is_int(self.rank) or self.rank < 1:
            p.append(f"rank={self.rank!r}: must be an integer >= 1")
        if not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            p.append(f"alpha={self.alpha!r}: must be > 0")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            p.append(f"dropout={self.dropout!r}: must be in [0, 1)")
        if not self.target_modules:
            p.append(
                f"target_modules={self.target_modules!r}: name at least one module (or 'all-linear')"
            )
        elif isinstance(self.target_modules, str) and self.target_modules != ALL_LINEAR:
            try:
                re.compile(self.target_modules)
            except re.error as err:
                p.append(
                    f"target_modules={self.target_modules!r}: not a valid regex ({err}); give a list of names"
                )
        if self.sync not in ("adapter", "merge"):
            p.append(f"sync={self.sync!r}: must be 'adapter' or 'merge'")
        return p


@dataclass(frozen=True)
class BaseFingerprint:
    """Identifies the frozen base an adapter was trained on (a checkpoint holds the adapter only)."""

    tensors: int
    elements: int
    checksum: float
    """float64 sum of every frozen tensor's sum: a different base (or revision) changes it."""
    names: list[str] = field(default_factory=list)
    """State-dict keys of the frozen base tensors (left out of checkpoints)."""


# -- building --------------------------------------------------------------------------------------------------------
def to_peft(cfg: LoraConfig):
    """The equivalent ``peft.LoraConfig``."""
    import peft

    targets = (
        cfg.target_modules
        if isinstance(cfg.target_modules, str)
        else list(cfg.target_modules)
    )
    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        modules_to_save=list(cfg.modules_to_save) if cfg.modules_to_save else None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int = 0) -> nn.Module:
    """``model`` wrapped by peft with a fresh adapter (B = 0: the wrapped policy equals the base at step 0).

    A's random init is drawn from ``seed`` (the global RNG is left as it was): every rank and every rerun of a
    seeded run starts from the same adapter, whatever drew from the global RNG before.
    """
    import peft

    check_targets(model, cfg)
    device = getattr(model, "device", torch.device("cpu"))
    # fork only the RNG the init may draw from
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        wrapped = peft.get_peft_model(model, to_peft(cfg), adapter_name=ADAPTER_NAME)
    # peft matched some entry; check_targets made sure all did
    if not isinstance(cfg.target_modules, str):
        return wrapped
    if not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in wrapped.modules()):
        raise ValueError(
            f"policy.lora.target_modules={cfg.target_modules!r} wrapped no module"
        )
    return wrapped


def check_targets(model: nn.Module, cfg: LoraConfig) -> None:
    """Refuse target_modules / modules_to_save entries that match no module, listing the names available."""
    names = [n for n, _ in model.named_modules() if n]
    problems = []
    targets = cfg.target_modules
    if isinstance(targets, str) and targets != ALL_LINEAR:
        if not any(re.fullmatch(targets, n) for n in names):
            problems.append(
                f"target_modules={targets!r} (a regex, matched against full module names)"
            )
    elif not isinstance(targets, str):
        problems += [
            f"target_modules entry {t!r}" for t in targets if not _matches(t, names)
        ]
    problems += [
        f"modules_to_save entry {m!r}"
        for m in cfg.modules_to_save or []
        if not _matches(m, names)
    ]
    tied = _tied_embedding_names(model)
    for entry in cfg.modules_to_save or []:
        if any(n == entry or n.endswith("." + entry) for n in tied):
            raise ValueError(
                f"policy.lora.modules_to_save entry {entry!r} is one of the model's tied embeddings "
                f"({', '.join(sorted(tied))}, tie_word_embeddings=true): a trained copy of one would untie them, and "
                "an engine loading tied weights drops it. Fix: leave it out (the adapter's layers train), or use a "
                "model with untied embeddings"
            )
    if problems:
        raise ValueError(
            f"policy.lora: {'; '.join(problems)} matches no module of {type(model).__name__}. Module names available "
            f"(last component; a list entry matches names ending in it): {', '.join(adaptable_names(model))}. "
            f"Fix: use those names, or target_modules: {ALL_LINEAR}"
        )


def _tied_embedding_names(model: nn.Module) -> set[str]:
    """Module names of the input and output embeddings when the model ties them (else empty)."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return set()
    tied = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    return {n for n, m in model.named_modules() if id(m) in tied}


def _matches(entry: str, names: list[str]) -> bool:
    return any(n == entry or n.endswith("." + entry) for n in names)


def adaptable_names(model: nn.Module) -> list[str]:
    """Sorted last components of the modules a LoRA adapter can wrap (linear, embedding, conv layers)."""
    from transformers.pytorch_utils import Conv1D

    kinds = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, Conv1D)
    return sorted(
        {
            n.rsplit(".", 1)[-1]
            for n, m in model.named_modules()
            if n and isinstance(m, kinds)
        }
    )


def check_strategy(cfg: LoraConfig | None, strategy) -> None:
    """Refuse LoRA under FSDP2 (before the policy is built): adapter sync and export read whole tensors."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    if cfg is not None and isinstance(strategy, ModelParallelStrategy):
        raise ValueError(
            "policy.lora under ModelParallelStrategy (FSDP2) is not supported yet: adapter sync and "
            "adapter checkpoints read whole tensors. Use DDP (--trainer.strategy=ddp): the frozen "
            "base needs no optimizer state, so LoRA usually fits without sharding"
        )


def is_lora(model: nn.Module | None) -> bool:
    """The policy carries a peft adapter."""
    return (
        model is not None
        and hasattr(model, "peft_config")
        and hasattr(model, "disable_adapter")
    )


@contextlib.contextmanager
def reference_mode(model: nn.Module) -> Iterator[None]:
    """The base policy (adapters and modules_to_save bypassed): the KL reference without a second copy."""
    with model.disable_adapter():
        yield


def fingerprint(model: nn.Module) -> BaseFingerprint:
    """Of every state-dict tensor that does not train (the base, tied aliases and buffers included); computed once,
    when the policy is built."""
    frozen = {
        n: t for n, t in model.state_dict(keep_vars=True).items() if not t.requires_grad
    }
    unique = list({id(t): t for t in frozen.values()}.values())
    with torch.no_grad():
        checksum = sum(float(t.detach().double().sum()) for t in unique)
    return BaseFingerprint(
        len(unique), sum(t.numel() for t in unique), checksum, sorted(frozen)
    )


# -- views of the weights ----------------------------------------------------------------------------------------------
def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapter in peft's saved format (names without the adapter name), detached, contiguous, on the CPU."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME)
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def _json_value(value: object) -> object:
    """What json cannot write itself: a set as a sorted list (peft's target_modules), the rest as a string."""
    return sorted(value) if isinstance(value, set) else str(value)


def adapter_config_json(model: nn.Module) -> str:
    """``adapter_config.json`` of the policy's adapter (what ``PeftModel.from_pretrained`` reads)."""
    cfg = model.peft_config[ADAPTER_NAME].to_dict()
    return json.dumps(
        cfg,
        indent=2,
        sort_keys=True,
        default=_json_value,
    )


def save_adapter(model: nn.Module, folder: str | os.PathLike) -> Path:
    """Write the adapter in peft's format into ``folder`` (replaced whole: written beside it, then renamed)."""
    return write_adapter_folder(
        adapter_state_dict(model), adapter_config_json(model), folder
    )


def write_adapter_folder(
    state: dict[str, Tensor], config_json: str, folder: str | os.PathLike
) -> Path:
    """``adapter_model.safetensors`` + ``adapter_config.json`` into ``folder``, atomically (temp folder + rename)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(config_json, encoding="utf-8")
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Trainable and total parameter counts."""
    params = list(model.parameters())
    return {
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "total": sum(p.numel() for p in params),
    }


def adapter_names(model: nn.Module) -> dict[str, str]:
    """Parameter name -> its key in peft's ``adapter_model.safetensors`` (matched by storage: no name rules)."""
    from peft import get_peft_model_state_dict

    saved = {
        t.data_ptr(): key
        for key, t in get_peft_model_state_dict(
            model, adapter_name=ADAPTER_NAME
        ).items()
    }
    return {
        n: saved[p.data_ptr()]
        for n, p in model.named_parameters()
        if p.data_ptr() in saved
    }
