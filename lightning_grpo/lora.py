"""LoRA policies through ``peft``: the ``policy.lora`` section, wrapping, and the weight views sync and checkpoints use.

``apply_lora`` wraps the loaded causal LM with ``peft.get_peft_model``: the base is frozen, so only the
adapter (and ``modules_to_save``) gets gradients and optimizer state. The KL reference is the same module
with its adapters disabled (``reference_mode``), never a second copy. Target modules are checked before
peft sees them: an entry that matches no module is refused with the names that exist.

Names: peft prefixes every tensor (``base_model.model.``), moves a wrapped layer's weight under
``base_layer`` and adds ``lora_A``/``lora_B``. ``engine_weights`` turns that back into the checkpoint
names an engine loaded (``model.layers.0.self_attn.q_proj.weight``): the base as it is (to re-sync an
engine that discarded its weights), or merged (``W + scale * B @ A``, computed on the fly, so the
trainer's base weights are never merged and unmerged in place and never drift).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_grpo.config import _raise_if

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
        p = []
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            p.append(f"rank={self.rank!r}: must be an integer >= 1")
        if not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            p.append(f"alpha={self.alpha!r}: must be > 0")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            p.append(f"dropout={self.dropout!r}: must be in [0, 1)")
        if not self.target_modules:
            p.append(f"target_modules={self.target_modules!r}: name at least one module (or 'all-linear')")
        elif isinstance(self.target_modules, str) and self.target_modules != ALL_LINEAR:
            try:
                re.compile(self.target_modules)
            except re.error as err:
                p.append(f"target_modules={self.target_modules!r}: not a valid regex ({err}); give a list of names")
        if self.sync not in ("adapter", "merge"):
            p.append(f"sync={self.sync!r}: must be 'adapter' or 'merge'")
        _raise_if(p, "policy.lora config")


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

    targets = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    return peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                           modules_to_save=list(cfg.modules_to_save) if cfg.modules_to_save else None,
                           bias="none", task_type="CAUSAL_LM")


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """``model`` wrapped by peft with a fresh adapter (B = 0: the wrapped policy equals the base at step 0)."""
    import peft

    check_targets(model, cfg)
    wrapped = peft.get_peft_model(model, to_peft(cfg), adapter_name=ADAPTER_NAME)
    if not isinstance(cfg.target_modules, str):  # peft matched some entry; check_targets made sure all did
        return wrapped
    if not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in wrapped.modules()):
        raise ValueError(f"policy.lora.target_modules={cfg.target_modules!r} wrapped no module")
    return wrapped


def check_targets(model: nn.Module, cfg: LoraConfig) -> None:
    """Refuse target_modules / modules_to_save entries that match no module, listing the names available."""
    names = [n for n, _ in model.named_modules() if n]
    problems = []
    targets = cfg.target_modules
    if isinstance(targets, str) and targets != ALL_LINEAR:
        if not any(re.fullmatch(targets, n) for n in names):
            problems.append(f"target_modules={targets!r} (a regex, matched against full module names)")
    elif not isinstance(targets, str):
        problems += [f"target_modules entry {t!r}" for t in targets if not _matches(t, names)]
    problems += [f"modules_to_save entry {m!r}" for m in cfg.modules_to_save or [] if not _matches(m, names)]
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
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and isinstance(m, kinds)})


def is_lora(model: nn.Module | None) -> bool:
    """The policy carries a peft adapter."""
    return model is not None and hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


@contextlib.contextmanager
def reference_mode(model: nn.Module) -> Iterator[None]:
    """The base policy (adapters and modules_to_save bypassed): the KL reference without a second copy."""
    with model.disable_adapter():
        yield


def fingerprint(model: nn.Module) -> BaseFingerprint:
    """Of every state-dict tensor that does not train (the base, tied aliases and buffers included); computed once,
    when the policy is built."""
    frozen = {n: t for n, t in model.state_dict(keep_vars=True).items() if not t.requires_grad}
    unique = list({id(t): t for t in frozen.values()}.values())
    with torch.no_grad():
        checksum = sum(float(t.detach().double().sum()) for t in unique)
    return BaseFingerprint(len(unique), sum(t.numel() for t in unique), checksum, sorted(frozen))


# -- views of the weights ----------------------------------------------------------------------------------------------
def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapter in peft's saved format (names without the adapter name), detached, contiguous, on the CPU."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME)
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def adapter_config_json(model: nn.Module) -> str:
    """``adapter_config.json`` of the policy's adapter (what ``PeftModel.from_pretrained`` reads)."""
    cfg = model.peft_config[ADAPTER_NAME].to_dict()
    return json.dumps(cfg, indent=2, sort_keys=True, default=lambda v: sorted(v) if isinstance(v, set) else str(v))


def save_adapter(model: nn.Module, folder: str | os.PathLike) -> Path:
    """Write the adapter in peft's format into ``folder`` (replaced whole: written beside it, then renamed)."""
    return write_adapter_folder(adapter_state_dict(model), adapter_config_json(model), folder)


def write_adapter_folder(state: dict[str, Tensor], config_json: str, folder: str | os.PathLike) -> Path:
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


def engine_weights(model: nn.Module, merged: bool, modules_to_save_only: bool = False) -> Iterator[tuple[str, Tensor]]:
    """The policy under the checkpoint names an engine loaded, each tensor computed when the sync reaches it.

    ``merged``: every adapted weight is ``W + scale * B @ A`` (for an engine without adapters); else the base ``W``
    (an engine that serves the adapter itself). Modules in ``modules_to_save`` come as trained either way;
    ``modules_to_save_only`` yields just those.
    """
    from lightning_grpo.rollout.weight_sync import named_weights

    base = model.get_base_model()
    layers = {name: module for name, module in base.named_modules() if _has_adapter(module)}
    for name, tensor in named_weights(base):
        engine_name = _engine_name(name)
        if engine_name is None or (modules_to_save_only and _TRAINED not in name):
            continue
        owner, _, leaf = name.rpartition(".")
        layer = layers.get(owner.removesuffix(".base_layer")) if owner.endswith(".base_layer") else None
        if merged and layer is not None and leaf == "weight":
            with torch.no_grad():
                tensor = tensor.detach() + layer.get_delta_weight(ADAPTER_NAME).to(tensor.dtype)
        yield engine_name, tensor


def _has_adapter(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A


_ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")
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
    tensors = {k: v for k, v in adapter_state_dict(model).items() if any(p in k for p in _ADAPTER_PARTS)}
    config = json.loads(adapter_config_json(model))
    config["modules_to_save"] = None
    return tensors, json.dumps(config, indent=2, sort_keys=True)


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Trainable and total parameter counts."""
    params = list(model.parameters())
    return {"trainable": sum(p.numel() for p in params if p.requires_grad), "total": sum(p.numel() for p in params)}


# -- checkpoints: the adapter, not the frozen base -----------------------------------------------------------------------
CHECKPOINT_KEY = "grpo_lora"


def drop_base(checkpoint: dict, base: BaseFingerprint, prefix: str, model: nn.Module) -> None:
    """Take the frozen base out of ``checkpoint["state_dict"]`` (it is rebuilt from ``policy.path``) and record what
    it was, plus the adapter config, so the adapter can be exported from the checkpoint alone."""
    state = checkpoint["state_dict"]
    for name in base.names:
        state.pop(prefix + name, None)
    checkpoint[CHECKPOINT_KEY] = {"base_tensors": base.tensors, "base_elements": base.elements,
                                  "base_checksum": base.checksum, "prefix": prefix,
                                  "adapter_config": adapter_config_json(model), "adapter_names": adapter_names(model)}


def restore_base(checkpoint: dict, own_state: dict[str, Tensor], base: BaseFingerprint, prefix: str) -> None:
    """Put this policy's frozen base back into a checkpoint written by ``drop_base``, after checking it is the
    base the adapter was trained on."""
    saved = checkpoint.get(CHECKPOINT_KEY)
    if saved is None:
        return  # a full checkpoint (written without LoRA, or by another tool): loaded as it is
    same = (saved["base_tensors"], saved["base_elements"]) == (base.tensors, base.elements)
    if not same or not math.isclose(saved["base_checksum"], base.checksum, rel_tol=1e-9, abs_tol=1e-6):
        raise ValueError(
            "this checkpoint's LoRA adapter was trained on another base model: its base had "
            f"{saved['base_tensors']} frozen tensors ({saved['base_elements']} elements, checksum "
            f"{saved['base_checksum']:.6g}), this policy's has {base.tensors} ({base.elements}, {base.checksum:.6g}). "
            "Fix: set policy.path (and revision, dtype) to the base the run was started with"
        )
    state = checkpoint["state_dict"]
    for name in base.names:
        state.setdefault(prefix + name, own_state[prefix + name])


def export_adapter(checkpoint_path: str | os.PathLike, folder: str | os.PathLike) -> Path:
    """Write the adapter held by a LoRA run's Lightning checkpoint (any writer) as a peft folder
    (``PeftModel.from_pretrained(base, folder)``). Loads with ``weights_only=True``."""
    ckpt = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    saved = ckpt.get(CHECKPOINT_KEY)
    if saved is None:
        raise ValueError(f"{checkpoint_path}: not a checkpoint of a LoRA run (no {CHECKPOINT_KEY!r} entry)")
    prefix, state = saved["prefix"], ckpt["state_dict"]
    adapter = {key: state[prefix + name].contiguous() for name, key in saved["adapter_names"].items()}
    return write_adapter_folder(adapter, saved["adapter_config"], folder)


def adapter_names(model: nn.Module) -> dict[str, str]:
    """Parameter name -> its key in peft's ``adapter_model.safetensors`` (matched by storage: no name rules)."""
    from peft import get_peft_model_state_dict

    saved = {t.data_ptr(): key for key, t in get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME).items()}
    return {n: saved[p.data_ptr()] for n, p in model.named_parameters() if p.data_ptr() in saved}


# -- publishing to an engine -------------------------------------------------------------------------------------------
def serves_adapters(engine: object) -> bool:
    """The engine takes a LoRA adapter itself (``VLLMEngine`` built with ``lora_rank``)."""
    return getattr(engine, "adapters", None) is not None and hasattr(engine, "load_adapter")


def push_policy(model: nn.Module, engine, bucket_bytes: int, with_base: bool, record=None):
    """Publish a LoRA policy: the adapter alone to an engine that serves adapters (plus modules_to_save as plain
    weights, and the base weights when ``with_base``: after a level-2 sleep discarded them), else every weight
    merged. ``record(named)`` wraps the pushed (name, tensor) stream. Returns the sync's ``SyncStats``."""
    import time

    from lightning_grpo.rollout.weight_sync import SyncStats, push_weights

    record = record or (lambda named: named)
    if not serves_adapters(engine):
        return push_weights(record(engine_weights(model, merged=True)), engine, bucket_bytes=bucket_bytes)
    start = time.perf_counter()
    named = list(engine_weights(model, merged=False, modules_to_save_only=not with_base))
    pushed = push_weights(record(named), engine, bucket_bytes=bucket_bytes) if named else None
    tensors, config = served_adapter(model)
    engine.load_adapter(tensors, config)
    engine.reset_prefix_cache()
    adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return SyncStats(n_buckets=(pushed.n_buckets if pushed else 0) + 1,
                     n_tensors=(pushed.n_tensors if pushed else 0) + len(tensors),
                     bytes=(pushed.bytes if pushed else 0) + adapter_bytes, seconds=time.perf_counter() - start)
