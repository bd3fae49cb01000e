"""Policy loading: any Hugging Face causal-LM folder, plus a tiny local policy factory.

``PolicyConfig.path`` is a folder in the Hugging Face layout (a real checkpoint or one
this module built). ``tiny:<name>`` builds a small random-init model with a locally made
character tokenizer into a cache folder once, then loads it through the very same
``from_pretrained`` path a real model takes. Nothing is downloaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Characters of the built-in tasks; ids 0-3 are the special tokens.
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list("0123456789+-*=()?:#, .abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n\\{}/_")


@dataclass
class TinyPolicySpec:
    """Shape of a locally built policy. head_dim >= 32 so vLLM's CPU attention accepts it."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    """Transformers architecture of the built model."""
    hidden_size: int = 128
    """Model width."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads (head_dim = hidden_size / num_heads)."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention when fewer than num_heads)."""
    intermediate_size: int = 256
    """MLP width."""
    max_position_embeddings: int = 256
    """Context length (prompt + completion tokens)."""
    vocab_size: int | None = None
    """None = the character tokenizer's size; larger pads the embedding (e.g. 32k for benchmarks)."""
    dropout: float = 0.0
    """Attention dropout; > 0 makes train() and eval() forwards differ (the determinism probe catches it)."""
    seed: int | None = None
    """Seed of the random initialization and the warm start; None = the module's seed (``model.seed``, else
    ``seed_everything``), 0 outside a module. Part of the cache key, as every field here."""


@dataclass
class PolicyConfig:
    """Which model to train and how to load it."""

    path: str = "tiny:default"
    """A Hugging Face model folder, or ``tiny:<name>`` for a locally built tiny policy (cached)."""
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the trained policy."""
    trust_remote_code: bool = False
    """Allow custom modeling code shipped in the folder. Off: loading never executes checkpoint code."""
    tiny: TinyPolicySpec | None = None
    """Shape used when ``path`` is ``tiny:<name>`` (None = TinyPolicySpec defaults)."""
    warm_start: str | None = None
    """Built-in task to supervise a ``tiny:`` policy on once, at build time (teaches the answer format)."""
    warm_start_steps: int = 200
    """Optimizer steps of that warm start (seconds on CPU; the result is cached with the build)."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("policy.path='': give a Hugging Face model folder or 'tiny:<name>'")
        if self.warm_start_steps < 0:
            raise ValueError(f"policy.warm_start_steps={self.warm_start_steps}: must be >= 0")


def make_char_tokenizer():
    """A character-level fast tokenizer built with the ``tokenizers`` library (no download)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def build_tiny_policy(out_dir: str | os.PathLike, spec: TinyPolicySpec | None = None) -> Path:
    """Build a random-init causal LM + char tokenizer and save both as a Hugging Face folder."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    spec = spec or TinyPolicySpec()
    tok = make_char_tokenizer()
    vocab = max(spec.vocab_size or 0, len(tok))
    cls = Qwen2Config if spec.arch == "qwen2" else LlamaConfig
    config = cls(
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
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed or 0)
        model = AutoModelForCausalLM.from_config(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def tiny_cache_dir(name: str, spec: TinyPolicySpec, warm: str = "") -> Path:
    root = Path(os.environ.get("LIGHTNING_GRPO_CACHE", Path.home() / ".cache" / "lightning_grpo"))
    key = "-".join(f"{v}" for v in vars(spec).values())
    return root / f"tiny-{name}-{key}{warm}"


def with_seed(cfg: PolicyConfig, seed: int) -> PolicyConfig:
    """``cfg`` with a ``tiny:`` policy's unset ``tiny.seed`` filled in: the policy a seeded run builds (and caches)."""
    if not cfg.path.startswith("tiny:") or (cfg.tiny is not None and cfg.tiny.seed is not None):
        return cfg
    return replace(cfg, tiny=replace(cfg.tiny or TinyPolicySpec(), seed=seed))


def resolve_path(cfg: PolicyConfig) -> Path:
    """The folder to load: ``cfg.path`` itself, or the cached tiny build (built on first use)."""
    if not cfg.path.startswith("tiny:"):
        path = Path(cfg.path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"policy.path={cfg.path!r} is not a folder. Give a local Hugging Face model folder "
                "(models are never downloaded at run time) or 'tiny:<name>' for a locally built tiny policy."
            )
        return path
    spec = with_seed(cfg, 0).tiny  # unseeded outside a module: 0, the same cache entry as an explicit 0
    warm = f"-warm-{cfg.warm_start}-{cfg.warm_start_steps}" if cfg.warm_start else ""
    folder = tiny_cache_dir(cfg.path.split(":", 1)[1] or "default", spec, warm)
    if not (folder / "config.json").exists():
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        build_tiny_policy(tmp, spec)
        if cfg.warm_start:
            _warm_start_folder(tmp, cfg.warm_start, cfg.warm_start_steps, spec.seed)
        if not folder.exists():  # another rank may have won the race
            os.replace(tmp, folder)
    return folder


def _warm_start_folder(folder: Path, task: str, steps: int, seed: int) -> None:
    """Supervise the freshly built policy on ``task`` and save it back (same folder layout)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_grpo.data.tasks import warm_start

    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    result = warm_start(model, tok, task, steps=steps, seed=seed)
    print(f"warm start of the tiny policy on {task!r}: {result.steps} steps, loss {result.loss:.3f}, "
          f"{result.seconds:.1f} s (cached in {folder.name})", flush=True)
    model.save_pretrained(folder, safe_serialization=True)


def load_policy(cfg: PolicyConfig) -> tuple[nn.Module, object]:
    """(model, tokenizer) from ``cfg``. Weights load from safetensors; remote code only if allowed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_path(cfg)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[cfg.dtype], trust_remote_code=cfg.trust_remote_code, use_safetensors=None
    )
    return model, tok
