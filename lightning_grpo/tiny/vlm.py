"""A tiny random-init Qwen2.5-VL (small vision tower) with a locally made tokenizer and image processor.

What tests and the VLM quickstart train: built from a config (nothing downloaded), saved as a
Hugging Face folder (``config.json``, safetensors, tokenizer, ``preprocessor_config.json``), and
loaded back through ``AutoModelForImageTextToText`` like any checkpoint. The tokenizer is the
character tokenizer plus Qwen-VL's vision tokens; its chat template renders TRL's multimodal
content parts (``{"type": "image"}``) as ``<|vision_start|><|image_pad|><|vision_end|>``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lightning_grpo.tiny.spec import TinyPolicySpec
from lightning_grpo.tiny.tokenizer import make_char_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

TINY_VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
"""``role: content`` lines (as the text tiny policies' template) with image parts as Qwen-VL vision tokens."""

PATCH = 14
MERGE = 2
MIN_PIXELS = 28 * 28
MAX_PIXELS = 112 * 112
"""Image sizes the tiny processor resizes into: 1 to 16 placeholder tokens per image (28x28 pixels each)."""


def mrope_section(head_dim: int) -> list[int]:
    """Qwen-VL's split of the rotary half-dimension into (temporal, height, width) parts ([16, 24, 24] at 128)."""
    half = head_dim // 2
    hw = 3 * half // 8
    return [half - 2 * hw, hw, hw]


def build_tiny_vlm(out_dir: str | os.PathLike, spec: TinyPolicySpec) -> Path:
    """Build a random-init Qwen2.5-VL shaped by ``spec`` and save it to ``out_dir``."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = vlm_tokenizer()
    config = vlm_config(spec, tok)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed or 0)
        model = AutoModelForImageTextToText.from_config(config)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    image_processor.save_pretrained(out)
    return out


def vlm_tokenizer():
    """The character tokenizer plus Qwen-VL's vision tokens, with the multimodal chat template."""
    tok = make_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = TINY_VLM_CHAT_TEMPLATE
    return tok


def vlm_config(spec: TinyPolicySpec, tok):
    """The ``Qwen2_5_VLConfig``: ``spec``'s text model, the small vision tower, ``tok``'s special ids."""
    from transformers import Qwen2_5_VLConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    specials = {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    return Qwen2_5_VLConfig(
        text_config=text_config(spec, len(tok), specials),
        vision_config=vision_config(spec),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        **specials,
    )


def text_config(spec: TinyPolicySpec, n_tokens: int, specials: dict) -> dict:
    """The language model's config: ``spec``'s shape, multimodal rotary (``mrope_section``), tied embeddings."""
    head_dim = spec.hidden_size // spec.num_heads
    return {
        "vocab_size": max(spec.vocab_size or 0, n_tokens),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "attention_dropout": spec.dropout,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": mrope_section(head_dim),
        },
        "tie_word_embeddings": True,
        **specials,
    }


def vision_config(spec: TinyPolicySpec) -> dict:
    """A small vision tower: 2 blocks of width 32 (head_dim 32, as vLLM's CPU attention needs), one windowed."""
    return {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 1,
        "out_hidden_size": spec.hidden_size,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    }
