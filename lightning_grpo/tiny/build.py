"""Build tiny policies: a random-init causal LM (or Qwen2.5-VL) with the char tokenizer, cached per spec.

``tiny_folder`` is where ``policy.resolve_path`` sends a ``tiny:<name>`` path: the folder is built once
(and warm-started once, when the config asks) into ``$LIGHTNING_GRPO_CACHE`` (default
``~/.cache/lightning_grpo``), keyed on every field of the spec, then loaded through the very same
``from_pretrained`` path as any checkpoint. A build the package ships (``shipped.py``: the quickstarts' warm
starts) is copied into the cache instead of trained.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lightning_grpo.tiny.shipped import build_key, copy_shipped
from lightning_grpo.tiny.spec import TinyPolicySpec
from lightning_grpo.tiny.tokenizer import (
    TINY_CHAT_TEMPLATE,
    TOKENIZER_VERSION,
    make_char_tokenizer,
)
from lightning_grpo.tiny.vlm import build_tiny_vlm
from lightning_grpo.tiny.warm import warm_start_folder

VLM_ARCH = "qwen2_5_vl"
"""The ``TinyPolicySpec.arch`` built as a vision-language model (``vlm.py``)."""


def build_tiny_policy(
    out_dir: str | os.PathLike, spec: TinyPolicySpec | None = None
) -> Path:
    """Build a random-init causal LM + char tokenizer and save both as a Hugging Face folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = spec or TinyPolicySpec()
    if spec.arch == VLM_ARCH:
        return build_tiny_vlm(out_dir, spec)
    tok = make_char_tokenizer()
    if spec.chat_template:
        tok.chat_template = TINY_CHAT_TEMPLATE
    vocab = max(spec.vocab_size or 0, len(tok))
    config = AutoConfig.for_model(
        spec.arch,
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        attention_dropout=spec.dropout,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
        initializer_range=spec.init_std,
        **_moe_fields(spec),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed or 0)
        model = AutoModelForCausalLM.from_config(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def _moe_fields(spec: TinyPolicySpec) -> dict:
    """Config fields of the sparse-MoE architectures (expert width = the MLP width / 2, head_dim explicit)."""
    if spec.arch in ("qwen2", "llama"):
        return {}
    experts = "num_local_experts" if spec.arch == "mixtral" else "num_experts"
    fields = {experts: spec.num_experts, "num_experts_per_tok": spec.experts_per_token}
    if spec.arch in ("qwen3_moe", "qwen2_moe"):
        fields["moe_intermediate_size"] = spec.intermediate_size // 2
    if spec.arch == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = spec.intermediate_size // 2
    if spec.arch in ("qwen3_moe", "mixtral"):
        fields["head_dim"] = spec.hidden_size // spec.num_heads
    if spec.arch == "mixtral":
        fields["router_jitter_noise"] = float(spec.router_jitter)
    return fields


def tiny_cache_dir(name: str, spec: TinyPolicySpec, warm: str = "") -> Path:
    """The cache folder of tiny policy ``name``: every field of ``spec``, the tokenizer version and the warm start."""
    root = Path(
        os.environ.get(
            "LIGHTNING_GRPO_CACHE", Path.home() / ".cache" / "lightning_grpo"
        )
    )
    key = "-".join(f"{v}" for v in vars(spec).values())
    return root / f"tiny-{name}-{key}-tok{TOKENIZER_VERSION}{warm}"


def tiny_folder(
    name: str,
    spec: TinyPolicySpec,
    warm_start: str | None = None,
    warm_start_steps: int = 200,
) -> Path:
    """The cached folder of tiny policy ``name`` shaped by ``spec`` (its seed set), built and warm-started once.

    Built under a per-process temp name and renamed into place, so concurrent ranks never see a half-written folder.
    """
    warm = f"-warm-{warm_start}-{warm_start_steps}" if warm_start else ""
    folder = tiny_cache_dir(name, spec, warm)
    if not (folder / "config.json").exists():
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        key = build_key(name, spec, warm_start, warm_start_steps)
        # the package ships the quickstarts' warm starts (shipped.py): copied, not trained
        if not copy_shipped(key, tmp):
            build_folder(tmp, spec, warm_start, warm_start_steps)
        if not folder.exists():  # another rank may have won the race
            os.replace(tmp, folder)
    return folder


def build_folder(
    out: Path, spec: TinyPolicySpec, warm_start: str | None, warm_start_steps: int
) -> Path:
    """Build the tiny policy of ``spec`` into ``out`` and warm-start it on ``warm_start`` (when given).

    What ``tiny_folder`` does on a cache miss, and ``tools/build_tiny_weights.py`` to make the shipped folders.
    """
    build_tiny_policy(out, spec)
    if warm_start:
        vision = spec.arch == VLM_ARCH
        warm_start_folder(out, warm_start, warm_start_steps, spec.seed, vision=vision)
    return out
