"""Policy loading: a Hugging Face Hub id or causal-LM folder (``tiny:<name>`` is handed to ``lightning_grpo.tiny``).

``PolicyConfig.path`` is a local folder in the Hugging Face layout, or a Hub id
(``Qwen/Qwen2.5-0.5B-Instruct``, at ``revision``) resolved through the Hub cache
(``HF_HOME`` / ``HF_HUB_CACHE``) with ``huggingface_hub.snapshot_download``: downloaded when
there is network, read from the cache when offline (``HF_HUB_OFFLINE=1``). Model, tokenizer
and chat template all load from that one folder, which the vLLM engine is built on too.
``tiny:<name>`` builds a small random-init model with a locally made character tokenizer into
a cache folder once (``lightning_grpo/tiny/``), then loads it through the very same
``from_pretrained`` path. Only a ``tiny:`` path imports anything under ``lightning_grpo/tiny/``
(tests/test_imports.py checks that loading a folder does not; jsonargparse reads ``tiny/spec.py`` to parse
``policy.tiny``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from lightning_grpo.checks import is_int, raise_problems
from lightning_grpo.lora import LoraConfig
from lightning_grpo.vision import VisionProcessor, freeze_vision_tower, is_vision_config

# only a tiny: path imports lightning_grpo.tiny; jsonargparse resolves the annotation from here
if TYPE_CHECKING:
    from lightning_grpo.tiny.spec import TinyPolicySpec

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass
class PolicyConfig:
    """Which model to train and how to load it."""

    path: str = "tiny:default"
    """A Hugging Face Hub id (``Qwen/Qwen2.5-0.5B-Instruct``), a local model folder, or ``tiny:<name>`` for a
    locally built tiny policy (cached). A Hub id resolves through the Hub cache (HF_HOME; offline: HF_HUB_OFFLINE=1)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of a Hub id; None = main. Ignored for folders."""
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the trained policy. float32 = fp32 master weights under trainer.precision bf16-mixed /
    16-mixed; bfloat16/float16 weights lose small updates (warned at fit start, docs/precision.md)."""
    trust_remote_code: bool = False
    """Allow custom modeling code shipped with the model. Off: loading never executes checkpoint code."""
    attn_implementation: str | None = None
    """Attention kernel passed to from_pretrained (``sdpa``, ``eager``, ``flash_attention_2``); None = transformers'
    default."""
    experts_implementation: Literal["eager", "batched_mm", "grouped_mm"] | None = None
    """Sparse-MoE policies: the experts kernel passed to from_pretrained. None = transformers' default
    (``grouped_mm``), except ``eager`` for a float64 policy: torch's grouped_mm takes no float64. Ignored by dense
    models."""
    chat_template: str | None = None
    """A Jinja chat template (or the path of a .jinja file) replacing the tokenizer's own; None = the tokenizer's."""
    tiny: TinyPolicySpec | None = None
    """Shape used when ``path`` is ``tiny:<name>`` (None = TinyPolicySpec defaults)."""
    warm_start: str | None = None
    """Built-in task to supervise a ``tiny:`` policy on once, at build time (teaches the answer format);
    ``arith_tools``: scripted calculator episodes, some with the tool, some without (teaches the call format)."""
    warm_start_steps: int = 200
    """Optimizer steps of that warm start (seconds on CPU; the result is cached with the build)."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter (peft) on the frozen model instead of every weight; None = full fine-tuning. See
    docs/lora.md."""
    train_vision_tower: bool = False
    """Vision-language policies: also train the vision encoder (patch embedding and blocks). False (common practice)
    freezes it; its merger (the projection into the language model) trains either way."""

    def __post_init__(self) -> None:
        raise_problems("policy config", self.problems())

    def problems(self) -> list[str]:
        """Every broken rule as a ``field=value: rule; fix`` line (the model itself is checked when it loads)."""
        p = []
        if not self.path:
            p.append(
                "policy.path='': give a Hugging Face Hub id, a model folder or 'tiny:<name>'"
            )
        if self.path.startswith("tiny:") and self.tiny is None:
            p += unknown_tiny(self.path)
        if not is_int(self.warm_start_steps) or self.warm_start_steps < 0:
            p.append(f"policy.warm_start_steps={self.warm_start_steps}: must be >= 0")
        if self.experts_implementation not in (
            None,
            "eager",
            "batched_mm",
            "grouped_mm",
        ):
            p.append(
                f"policy.experts_implementation={self.experts_implementation!r}: must be one of None, 'eager', "
                "'batched_mm', 'grouped_mm'"
            )
        elif self.experts_implementation == "grouped_mm" and self.dtype == "float64":
            p.append(
                "policy.experts_implementation='grouped_mm' with policy.dtype='float64': torch's grouped_mm has "
                "no float64 kernel; use 'eager' or 'batched_mm' (or leave it unset)"
            )
        return p


def unknown_tiny(path: str) -> list[str]:
    """A ``tiny:`` name the package does not know, with no shape given: a typo would build the default shape."""
    # a dataclass module: no torch, no builder
    from lightning_grpo.tiny.spec import TINY_NAMES

    if (path.removeprefix("tiny:") or "default") in TINY_NAMES:
        return []
    return [
        f"policy.path={path!r}: not a known tiny policy ({', '.join(TINY_NAMES)}); a tiny: name labels a locally "
        "built shape, so a new one needs its shape under policy.tiny (e.g. policy.tiny.hidden_size: 128). Or give "
        "a model folder or a Hub id"
    ]


def with_seed(cfg: PolicyConfig, seed: int) -> PolicyConfig:
    """``cfg`` with a ``tiny:`` policy's unset ``tiny.seed`` filled in: the policy a seeded run builds (and caches)."""
    if not cfg.path.startswith("tiny:") or (
        cfg.tiny is not None and cfg.tiny.seed is not None
    ):
        return cfg
    # a tiny: path only (see resolve_path)
    from lightning_grpo.tiny.spec import TinyPolicySpec

    return replace(cfg, tiny=replace(cfg.tiny or TinyPolicySpec(), seed=seed))


def resolve_path(cfg: PolicyConfig) -> Path:
    """The folder to load: a local folder, the Hub cache's snapshot of a Hub id, or the cached tiny build."""
    if not cfg.path.startswith("tiny:"):
        path = Path(cfg.path).expanduser()
        if path.is_dir():
            return check_model_folder(cfg.path, path)
        if HUB_ID.match(cfg.path):
            return hub_snapshot(cfg.path, cfg.revision, cfg.trust_remote_code)
        raise PolicyNotFoundError(
            f"policy.path={cfg.path!r} is neither a local folder nor a Hugging Face Hub id ('org/name'). Give a "
            "local Hugging Face model folder, a Hub id, or 'tiny:<name>' for a locally built tiny policy."
        )
    # Deferred on purpose: only a tiny: path enters lightning_grpo.tiny (the builder, its warm starts and the built-in
    # tasks they train on), so loading a real model never imports them. No cycle: lightning_grpo.tiny never imports
    # this module.
    from lightning_grpo.tiny.build import tiny_folder

    # unseeded outside a module: 0, the same cache entry as an explicit 0
    spec = with_seed(cfg, 0).tiny
    return tiny_folder(
        cfg.path.split(":", 1)[1] or "default",
        spec,
        cfg.warm_start,
        cfg.warm_start_steps,
    )


def check_model_folder(given: str, path: Path) -> Path:
    """A local ``policy.path`` must hold a model (``config.json`` naming its ``model_type``) and a tokenizer:
    refused here, naming what the folder holds, instead of transformers' guess at the cause ("You need to have
    sentencepiece or tiktoken installed")."""
    config = path / "config.json"
    try:
        has_type = "model_type" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        has_type = False
    missing = ([] if has_type else ["config.json with a model_type"]) + (
        []
        if any((path / f).is_file() for f in TOKENIZER_FILES)
        else [f"tokenizer file ({', '.join(TOKENIZER_FILES)})"]
    )
    if missing:
        held = sorted(p.name for p in path.iterdir())[:8]
        raise PolicyNotFoundError(
            f"policy.path={given!r} is a folder but not a Hugging Face model: no {' and no '.join(missing)} (it "
            f"holds {held or 'nothing'}). Give the folder save_pretrained wrote (config.json, weights, tokenizer files)."
        )
    return path


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)
"""Any one of them: a tokenizer transformers can load."""

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
"""What a Hub model id looks like (``name`` or ``org/name``)."""
# Enough to load a causal LM and its tokenizer: no legacy *.bin, no ONNX/GGUF exports.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
_SNAPSHOTS: dict[tuple[str, str | None, bool], Path] = {}


class PolicyNotFoundError(FileNotFoundError):
    """``policy.path`` names no usable folder or Hub model; the message names it and the fix."""


def hub_snapshot(
    repo_id: str, revision: str | None, trust_remote_code: bool = False
) -> Path:
    """The local snapshot folder of Hub model ``repo_id`` (downloaded if online; from the Hub cache if offline).

    Resolved once per process, so the trainer, the tokenizer and the vLLM engine read the very same folder.
    """
    key = (repo_id, revision, trust_remote_code)
    if key not in _SNAPSHOTS:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        at = f"{repo_id!r} (revision {revision or 'main'})"
        # code only when it may run
        patterns = HUB_FILES + (["*.py"] if trust_remote_code else [])
        try:
            _SNAPSHOTS[key] = Path(
                snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
            )
        except LocalEntryNotFoundError:
            raise PolicyNotFoundError(
                f"policy.path={repo_id!r}: not a local folder, and Hub model {at} is not in the Hub cache "
                f"{constants.HF_HUB_CACHE} while offline (HF_HUB_OFFLINE=1 or no network). Fix: download it once "
                f"where there is network (`hf download {repo_id}`) and point HF_HOME/HF_HUB_CACHE at that cache, "
                "or set policy.path to a local model folder"
                # the whole story is above: huggingface_hub's chained error would only repeat it
            ) from None
        except RevisionNotFoundError as err:
            raise PolicyNotFoundError(
                f"policy.revision={revision!r}: Hub model {repo_id!r} has no such "
                "revision; give a branch, tag or commit of it"
            ) from err
        except RepositoryNotFoundError as err:
            raise PolicyNotFoundError(
                f"policy.path={repo_id!r}: no such model on the Hugging Face Hub (or it is gated/private: set "
                "HF_TOKEN), and no local folder of that name"
            ) from err
    return _SNAPSHOTS[key]


def vision_config_of(folder: Path, trust_remote_code: bool = False) -> bool:
    """Whether the model in ``folder`` is a vision-language model (its config has a vision tower)."""
    from transformers import AutoConfig

    return is_vision_config(
        AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    )


def _model_class(folder: Path, trust_remote_code: bool = False):
    """``AutoModelForImageTextToText`` for a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), else
    ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return (
        AutoModelForImageTextToText
        if vision_config_of(folder, trust_remote_code)
        else AutoModelForCausalLM
    )


def load_vision(cfg: PolicyConfig, tokenizer, model: nn.Module):
    """The policy's ``VisionProcessor`` (image processor of its folder), or None for a text-only policy.

    Unless ``cfg.train_vision_tower``, the vision encoder is frozen here (before the optimizer sees it).
    """
    if not is_vision_config(getattr(model, "config", None)):
        return None
    if not cfg.train_vision_tower:
        freeze_vision_tower(model)
    dtype = next(model.parameters()).dtype
    return VisionProcessor.from_pretrained(resolve_path(cfg), tokenizer, dtype=dtype)


def experts_kernel(cfg: PolicyConfig) -> str | None:
    """The experts kernel to ask transformers for (None = its default, ``grouped_mm``).

    transformers 5.x picks ``grouped_mm`` for every MoE whatever the dtype, and torch's grouped_mm raises "Expected
    mat_a to be Float32, BFloat16 or Float16 matrix, got Double" at the first float64 forward; ``eager`` (a loop over
    the hit experts) computes the same sums in float64.
    """
    if cfg.experts_implementation is not None:
        return cfg.experts_implementation
    return "eager" if cfg.dtype == "float64" else None


def load_policy(cfg: PolicyConfig) -> tuple[nn.Module, object]:
    """(model, tokenizer) from ``cfg``, both from one folder. Weights load from safetensors; remote code only if
    allowed. A vision-language model loads through ``AutoModelForImageTextToText`` (``load_vision`` gives its
    image side)."""
    from transformers import AutoTokenizer

    path = resolve_path(cfg)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if cfg.chat_template is not None:
        template = Path(cfg.chat_template).expanduser()
        is_file = cfg.chat_template.endswith(".jinja") or (
            "{" not in cfg.chat_template and template.is_file()
        )
        tok.chat_template = (
            template.read_text(encoding="utf-8") if is_file else cfg.chat_template
        )
    extra = (
        {}
        if cfg.attn_implementation is None
        else {"attn_implementation": cfg.attn_implementation}
    )
    experts = experts_kernel(cfg)
    if experts is not None:
        extra["experts_implementation"] = experts
    model = _model_class(path, cfg.trust_remote_code).from_pretrained(
        path,
        dtype=DTYPES[cfg.dtype],
        trust_remote_code=cfg.trust_remote_code,
        use_safetensors=None,
        **extra,
    )
    return model, tok
