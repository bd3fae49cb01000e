"""Prompts as the tokenizer sees them: plain strings, or chat messages through the chat template.

A conversational prompt (TRL's format: ``[{"role": "user", "content": "..."}]``) becomes the string
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` and is then
tokenized without extra special tokens (the template places them), the way TRL does it. A plain
string is tokenized as it is (``encode_prompt``, the encoding the warm starts train on too).

``fit_items`` checks a prompt set against the policy once, before training: chat prompts need a
chat template, and a prompt longer than ``rollout.max_prompt_tokens`` is dropped (counted and
warned once) or refused, so one long prompt never aborts a run halfway.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from lightning_grpo.checks import ConfigError
from lightning_grpo.data.items import TaskItem


class ChatTemplateError(ConfigError):
    """Chat-message prompts met a tokenizer without a chat template; the message gives the fixes."""


class LongPromptsError(ConfigError):
    """Prompts over the limit were refused; ``shortest`` is the length of the shortest one (in tokens)."""

    def __init__(self, message: str, shortest: int) -> None:
        super().__init__(message)
        self.shortest = shortest


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt token ids of a plain string. The one place prompt text becomes tokens, so warm start and rollouts
    agree."""
    return list(tokenizer(text)["input_ids"])


def is_messages(value: Any) -> bool:
    """True for a TRL conversational prompt: a non-empty list of ``{"role", "content"}`` mappings."""
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) > 0
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m
            for m in value
        )
    )


def with_system(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """``messages`` with ``system_prompt`` as the first (system) message, unless they already open with one."""
    if system_prompt is None or (messages and messages[0].get("role") == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def check_chat_template(tokenizer, where: str) -> None:
    """Raise ``ChatTemplateError`` if ``tokenizer`` cannot render chat messages."""
    if getattr(tokenizer, "chat_template", None):
        return
    raise ChatTemplateError(
        f"{where}: the prompts are chat messages but the policy's tokenizer has no chat template. Use a model "
        "whose tokenizer has one (an -Instruct/-Chat checkpoint), set policy.chat_template to a Jinja template "
        "(or a .jinja file), or give plain-string prompts"
    )


def render(tokenizer, messages: list[dict]) -> str:
    """The prompt string a chat model expects, ending with the assistant turn's opening."""
    check_chat_template(tokenizer, "prompt")
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def encode(tokenizer, text: str, messages: list[dict] | None) -> tuple[list[int], str]:
    """``(token ids, prompt string)`` of one prompt: chat-templated when it has ``messages``, else plain."""
    if messages is None:
        return encode_prompt(tokenizer, text), text
    rendered = render(tokenizer, messages)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"]), rendered


def prompt_lengths(tokenizer, items: Sequence[TaskItem]) -> list[int]:
    """Token count of each item's prompt, encoded exactly as ``encode`` does (batched)."""
    plain = [i for i, it in enumerate(items) if it.messages is None]
    chat = [i for i, it in enumerate(items) if it.messages is not None]
    lengths = [0] * len(items)
    if plain:
        for i, ids in zip(
            plain, tokenizer([items[i].text for i in plain])["input_ids"]
        ):
            lengths[i] = len(ids)
    if chat:
        rendered = [render(tokenizer, items[i].messages) for i in chat]
        for i, ids in zip(
            chat, tokenizer(rendered, add_special_tokens=False)["input_ids"]
        ):
            lengths[i] = len(ids)
    return lengths


def fit_items(
    items: Sequence[TaskItem],
    tokenizer,
    max_tokens: int | None,
    on_long: Literal["drop", "error"],
    where: str,
) -> tuple[list[TaskItem], list[int]]:
    """``(kept items, their indices in items)``: prompts over ``max_tokens`` dropped (warned once) or refused.

    Raises:
        ChatTemplateError: chat prompts and a tokenizer without a chat template.
        LongPromptsError: ``on_long="error"`` and a prompt is too long, or every prompt is too long.
    """
    if any(it.messages is not None for it in items):
        check_chat_template(tokenizer, where)
    if max_tokens is None:
        return list(items), list(range(len(items)))
    lengths = prompt_lengths(tokenizer, items)
    long = [i for i, n in enumerate(lengths) if n > max_tokens]
    if not long:
        return list(items), list(range(len(items)))
    first = f"first: row {long[0]}, {lengths[long[0]]} tokens"
    if on_long == "error" or len(long) == len(items):
        raise LongPromptsError(
            f"{where}: {len(long)} of {len(items)} prompts are longer than rollout.max_prompt_tokens={max_tokens} "
            f"({first}). Raise rollout.max_prompt_tokens (with the model's context in mind), shorten the prompts, "
            f"or set rollout.long_prompts=drop{' (every prompt is too long here)' if len(long) == len(items) else ''}",
            min(lengths[i] for i in long),
        )
    warnings.warn(
        f"{where}: dropped {len(long)} of {len(items)} prompts longer than rollout.max_prompt_tokens={max_tokens} "
        f"({first}); counted in data/long_prompts_dropped. Set rollout.long_prompts=error to refuse them instead",
        stacklevel=2,
    )
    kept = [i for i in range(len(items)) if lengths[i] <= max_tokens]
    return [items[i] for i in kept], kept
