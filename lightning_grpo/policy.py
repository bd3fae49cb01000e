"""Policy loading: a Hugging Face Hub id or causal-LM folder, plus a tiny local policy factory.

``PolicyConfig.path`` is a local folder in the Hugging Face layout, or a Hub id
(``Qwen/Qwen2.5-0.5B-Instruct``, at ``revision``) resolved through the Hub cache
(``HF_HOME`` / ``HF_HUB_CACHE``) with ``huggingface_hub.snapshot_download``: downloaded when
there is network, read from the cache when offline (``HF_HUB_OFFLINE=1``). Model, tokenizer
and chat template all load from that one folder, which the vLLM engine is built on too.
``tiny:<name>`` builds a small random-init model with a locally made character tokenizer into
a cache folder once, then loads it through the very same ``from_pretrained`` path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from lightning_grpo.checks import is_finite, is_int, raise_problems
from lightning_grpo.lora import LoraConfig

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}

TOKENIZER_VERSION = 2
"""Bumped when the char tokenizer's files change (part of the tiny cache key): 2 = byte-level spelling."""
# Characters of the built-in tasks; ids 0-3 are the special tokens.
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list("0123456789+-*=()?:#, .abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n\\{}/_")


@dataclass
class TinyPolicySpec:
    """Shape of a locally built policy. head_dim >= 32 so vLLM's CPU attention accepts it."""

    arch: Literal["qwen2", "llama", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen2_5_vl"] = "qwen2"
    """Transformers architecture of the built model; the ``*moe``/mixtral ones are sparse MoE (see docs/moe.md);
    ``qwen2_5_vl`` = a vision-language Qwen2.5-VL (a small vision tower plus this text model; ``tiny_vlm.py``) for
    image prompts."""
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
    num_experts: int = 4
    """MoE architectures only: routed experts per MoE layer."""
    experts_per_token: int = 2
    """MoE architectures only: top-k experts each token is routed to."""
    router_jitter: float = 0.0
    """Mixtral only: ``router_jitter_noise``, a train()-mode multiplicative noise on the MoE input (routing churn)."""
    init_std: float = 0.02
    """Std of the random initialization (``initializer_range``); larger gives a sharper, routing-sensitive model."""
    seed: int | None = None
    """Seed of the random initialization and the warm start; None = the module's seed (``model.seed``, else
    ``seed_everything``), 0 outside a module. Part of the cache key, as every field here."""
    chat_template: bool = False
    """Give the char tokenizer ``TINY_CHAT_TEMPLATE`` (a plain-text chat format), so chat-message prompts work."""

    def __post_init__(self) -> None:
        raise_problems("policy.tiny config", self.problems())

    def problems(self) -> list[str]:
        """Every broken rule as a ``field=value: rule; fix`` line (shapes transformers would refuse later)."""
        p = [f"{name}={getattr(self, name)!r}: must be an integer >= 1"
             for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                          "max_position_embeddings", "num_experts", "experts_per_token")
             if not is_int(getattr(self, name)) or getattr(self, name) < 1]
        if not p and self.hidden_size % self.num_heads:
            p.append(f"hidden_size={self.hidden_size}: must divide by num_heads={self.num_heads} (head_dim)")
        if not p and self.num_heads % self.num_kv_heads:
            p.append(f"num_kv_heads={self.num_kv_heads}: must divide num_heads={self.num_heads}")
        if not p and self.experts_per_token > self.num_experts:
            p.append(f"experts_per_token={self.experts_per_token}: must not exceed num_experts={self.num_experts}")
        if self.vocab_size is not None and (not is_int(self.vocab_size) or self.vocab_size < 1):
            p.append(f"vocab_size={self.vocab_size!r}: must be a positive integer or null (the tokenizer's size)")
        if not is_finite(self.dropout) or not 0 <= self.dropout < 1:
            p.append(f"dropout={self.dropout!r}: must be in [0, 1)")
        if not is_finite(self.router_jitter) or self.router_jitter < 0:
            p.append(f"router_jitter={self.router_jitter!r}: must be a finite number >= 0 (0 = off)")
        if not is_finite(self.init_std) or self.init_std <= 0:
            p.append(f"init_std={self.init_std!r}: must be a finite number > 0")
        return p


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
    chat_template: str | None = None
    """A Jinja chat template (or the path of a .jinja file) replacing the tokenizer's own; None = the tokenizer's."""
    tiny: TinyPolicySpec | None = None
    """Shape used when ``path`` is ``tiny:<name>`` (None = TinyPolicySpec defaults)."""
    warm_start: str | None = None
    """Built-in task to supervise a ``tiny:`` policy on once, at build time (teaches the answer format)."""
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
            p.append("policy.path='': give a Hugging Face Hub id, a model folder or 'tiny:<name>'")
        if not is_int(self.warm_start_steps) or self.warm_start_steps < 0:
            p.append(f"policy.warm_start_steps={self.warm_start_steps}: must be >= 0")
        return p


def make_char_tokenizer():
    """A character-level fast tokenizer built with the ``tokenizers`` library (no download).

    Saved in byte-level form (a BPE with no merges; space and newline spelled ``Ġ`` and ``Ċ``), because
    transformers 5 loads a qwen2 folder's tokenizer as ``Qwen2Tokenizer``, which rebuilds a byte-level BPE
    from the saved vocab: spelled any other way, whitespace would silently vanish from every prompt.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = {" ": "Ġ", "\n": "Ċ"}
    vocab = {byte_level.get(tok, tok): i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
"""A chat template the char tokenizer can spell (letters, ':', space, newline): ``role: content`` lines."""


def build_tiny_policy(out_dir: str | os.PathLike, spec: TinyPolicySpec | None = None) -> Path:
    """Build a random-init causal LM + char tokenizer and save both as a Hugging Face folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = spec or TinyPolicySpec()
    if spec.arch == "qwen2_5_vl":
        from lightning_grpo.tiny_vlm import build_tiny_vlm

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
    root = Path(os.environ.get("LIGHTNING_GRPO_CACHE", Path.home() / ".cache" / "lightning_grpo"))
    key = "-".join(f"{v}" for v in vars(spec).values())
    return root / f"tiny-{name}-{key}-tok{TOKENIZER_VERSION}{warm}"


def with_seed(cfg: PolicyConfig, seed: int) -> PolicyConfig:
    """``cfg`` with a ``tiny:`` policy's unset ``tiny.seed`` filled in: the policy a seeded run builds (and caches)."""
    if not cfg.path.startswith("tiny:") or (cfg.tiny is not None and cfg.tiny.seed is not None):
        return cfg
    return replace(cfg, tiny=replace(cfg.tiny or TinyPolicySpec(), seed=seed))


def resolve_path(cfg: PolicyConfig) -> Path:
    """The folder to load: a local folder, the Hub cache's snapshot of a Hub id, or the cached tiny build."""
    if not cfg.path.startswith("tiny:"):
        path = Path(cfg.path).expanduser()
        if path.is_dir():
            return path
        if HUB_ID.match(cfg.path):
            return hub_snapshot(cfg.path, cfg.revision, cfg.trust_remote_code)
        raise PolicyNotFoundError(
            f"policy.path={cfg.path!r} is neither a local folder nor a Hugging Face Hub id ('org/name'). Give a "
            "local Hugging Face model folder, a Hub id, or 'tiny:<name>' for a locally built tiny policy."
        )
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


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
"""What a Hub model id looks like (``name`` or ``org/name``)."""
# Enough to load a causal LM and its tokenizer: no legacy *.bin, no ONNX/GGUF exports.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
_SNAPSHOTS: dict[tuple[str, str | None, bool], Path] = {}


class PolicyNotFoundError(FileNotFoundError):
    """``policy.path`` names no usable folder or Hub model; the message names it and the fix."""


def hub_snapshot(repo_id: str, revision: str | None, trust_remote_code: bool = False) -> Path:
    """The local snapshot folder of Hub model ``repo_id`` (downloaded if online; from the Hub cache if offline).

    Resolved once per process, so the trainer, the tokenizer and the vLLM engine read the very same folder.
    """
    key = (repo_id, revision, trust_remote_code)
    if key not in _SNAPSHOTS:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

        at = f"{repo_id!r} (revision {revision or 'main'})"
        patterns = HUB_FILES + (["*.py"] if trust_remote_code else [])  # code only when it may run
        try:
            _SNAPSHOTS[key] = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
        except LocalEntryNotFoundError:
            raise PolicyNotFoundError(
                f"policy.path={repo_id!r}: not a local folder, and Hub model {at} is not in the Hub cache "
                f"{constants.HF_HUB_CACHE} while offline (HF_HUB_OFFLINE=1 or no network). Fix: download it once "
                f"where there is network (`hf download {repo_id}`) and point HF_HOME/HF_HUB_CACHE at that cache, "
                "or set policy.path to a local model folder"
            ) from None  # the whole story is above: huggingface_hub's chained error would only repeat it
        except RevisionNotFoundError as err:
            raise PolicyNotFoundError(f"policy.revision={revision!r}: Hub model {repo_id!r} has no such "
                                      "revision; give a branch, tag or commit of it") from err
        except RepositoryNotFoundError as err:
            raise PolicyNotFoundError(
                f"policy.path={repo_id!r}: no such model on the Hugging Face Hub (or it is gated/private: set "
                "HF_TOKEN), and no local folder of that name"
            ) from err
    return _SNAPSHOTS[key]


def _warm_start_folder(folder: Path, task: str, steps: int, seed: int) -> None:
    """Supervise the freshly built policy on ``task`` and save it back (same folder layout)."""
    from transformers import AutoTokenizer

    from lightning_grpo.data.tasks import warm_start

    model, tok = _model_class(folder).from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    if vision_config_of(folder):
        from lightning_grpo.data.visual import warm_start_vision
        from lightning_grpo.vision import VisionProcessor

        result = warm_start_vision(model, tok, VisionProcessor.from_pretrained(folder, tok), task, steps=steps,
                                   seed=seed)
    else:
        result = warm_start(model, tok, task, steps=steps, seed=seed)
    print(f"warm start of the tiny policy on {task!r}: {result.steps} steps, loss {result.loss:.3f}, "
          f"{result.seconds:.1f} s (cached in {folder.name})", flush=True)
    model.save_pretrained(folder, safe_serialization=True)


def vision_config_of(folder: Path, trust_remote_code: bool = False) -> bool:
    """Whether the model in ``folder`` is a vision-language model (its config has a vision tower)."""
    from transformers import AutoConfig

    from lightning_grpo.vision import is_vision_config

    return is_vision_config(AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code))


def _model_class(folder: Path, trust_remote_code: bool = False):
    """``AutoModelForImageTextToText`` for a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), else
    ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if vision_config_of(folder, trust_remote_code) else AutoModelForCausalLM


def load_vision(cfg: PolicyConfig, tokenizer, model: nn.Module):
    """The policy's ``VisionProcessor`` (image processor of its folder), or None for a text-only policy.

    Unless ``cfg.train_vision_tower``, the vision encoder is frozen here (before the optimizer sees it).
    """
    from lightning_grpo.vision import VisionProcessor, freeze_vision_tower, is_vision_config

    if not is_vision_config(getattr(model, "config", None)):
        return None
    if not cfg.train_vision_tower:
        freeze_vision_tower(model)
    dtype = next(model.parameters()).dtype
    return VisionProcessor.from_pretrained(resolve_path(cfg), tokenizer, dtype=dtype)


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
        is_file = cfg.chat_template.endswith(".jinja") or ("{" not in cfg.chat_template and template.is_file())
        tok.chat_template = template.read_text(encoding="utf-8") if is_file else cfg.chat_template
    extra = {} if cfg.attn_implementation is None else {"attn_implementation": cfg.attn_implementation}
    model = _model_class(path, cfg.trust_remote_code).from_pretrained(
        path, dtype=DTYPES[cfg.dtype], trust_remote_code=cfg.trust_remote_code, use_safetensors=None, **extra
    )
    return model, tok
