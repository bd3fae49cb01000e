"""The character tokenizer of tiny policies, built locally with the ``tokenizers`` library (no download)."""

from __future__ import annotations

TOKENIZER_VERSION = 2
"""Bumped when the char tokenizer's files change (part of the tiny cache key): 2 = byte-level spelling."""
# Characters of the built-in tasks; ids 0-3 are the special tokens.
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list(
    "0123456789+-*=()?:#, .abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n\\{}/_"
)


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
    core.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=False
    )
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
"""A chat template the char tokenizer can spell (letters, ':', space, newline): ``role: content`` lines."""
