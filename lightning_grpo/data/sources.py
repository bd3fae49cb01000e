"""Prompt sources -> ``TaskItem`` lists: a JSONL file, a ``datasets``-like object, or ``builtin:<task>``.

Every row problem is reported with where it is (file and line, or row index), what is
wrong and how to fix it, before any model is built.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_grpo.data.tasks import TEMPLATES, Split, TaskItem, get_task


class PromptDataError(ValueError):
    """A prompt source is missing, empty, or has a malformed row; the message says where and how to fix it."""


def load_items(
    source: Any,
    *,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    prompt_template: str | None = None,
    size: int = 10_000,
    seed: int = 0,
    split: Split = "train",
) -> list[TaskItem]:
    """The items of ``source``; raises ``PromptDataError`` on a bad row or an empty result.

    Args:
        source: ``"builtin:<task>"``, a path to a ``.jsonl`` file, or an object with ``len`` and
            integer indexing that yields mappings (a ``datasets.Dataset``, a list of dicts).
        prompt_key: column holding the prompt text (files and dataset objects).
        answer_key: column holding the reference answer; None when the rows have none.
        prompt_template: a name in ``tasks.TEMPLATES`` or a format string with ``{prompt}``; None = as is.
        size: items drawn from a built-in task (files and datasets give all their rows).
        seed: seed of a built-in task's draw.
        split: ``"train"`` or ``"val"`` (built-in tasks keep the two disjoint).
    """
    template = resolve_template(prompt_template)
    if isinstance(source, str) and source.startswith("builtin:"):
        items = get_task(source.split(":", 1)[1]).items(size, seed, split)
    elif isinstance(source, (str, Path)):
        items = _read_jsonl(Path(source), prompt_key, answer_key)
    elif hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        items = [_row_item(source[i], prompt_key, answer_key, f"dataset row {i}") for i in range(len(source))]
    else:
        raise PromptDataError(
            f"source={source!r}: give 'builtin:<task>', a .jsonl path, or a datasets.Dataset / list of dicts"
        )
    if not items:
        raise PromptDataError(f"source={_name(source)}: the {split} prompt set is empty; it needs at least one prompt")
    if template != "{prompt}":
        items = [TaskItem(template.format(prompt=it.text), it.answer, it.meta) for it in items]
    return items


def resolve_template(template: str | None) -> str:
    """The format string a ``prompt_template`` setting means."""
    if template is None:
        return "{prompt}"
    template = TEMPLATES.get(template, template)
    if "{prompt}" not in template:
        raise PromptDataError(
            f"prompt_template={template!r}: must be one of {sorted(TEMPLATES)} or a format string containing "
            "'{prompt}' (literal braces doubled: '{{' and '}}')"
        )
    return template


def _read_jsonl(path: Path, prompt_key: str, answer_key: str | None) -> list[TaskItem]:
    if path.suffix not in (".jsonl", ".json") or not path.is_file():
        raise PromptDataError(
            f"source={str(path)!r}: not an existing .jsonl file and not 'builtin:<task>' "
            "(JSON Lines: one object per line)"
        )
    items = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise PromptDataError(
                    f"{where}: not valid JSON ({err.msg}); each line must be one JSON object"
                ) from err
            items.append(_row_item(row, prompt_key, answer_key, where))
    return items


def _row_item(row: Any, prompt_key: str, answer_key: str | None, where: str) -> TaskItem:
    if not isinstance(row, Mapping):
        raise PromptDataError(f"{where}: a row must be an object with named columns, got {type(row).__name__}")
    keys = sorted(row)
    if prompt_key not in row:
        raise PromptDataError(
            f"{where}: no key {prompt_key!r} (the row has {keys}). Set prompt_key "
            f"(CLI: --data.prompt_key) to the column holding the prompt text"
        )
    if answer_key is not None and answer_key not in row:
        raise PromptDataError(
            f"{where}: no key {answer_key!r} (the row has {keys}). Set answer_key (CLI: --data.answer_key) to the "
            "column holding the reference answer, or to null if the prompts have none"
        )
    text = row[prompt_key]
    if not isinstance(text, str) or not text:
        raise PromptDataError(f"{where}: {prompt_key!r} must be a non-empty string, got {text!r}")
    answer = None if answer_key is None or row[answer_key] is None else str(row[answer_key])
    meta = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
    return TaskItem(text, answer, meta)


def _name(source: Any) -> str:
    return repr(source) if isinstance(source, (str, Path)) else f"<{type(source).__name__} of {len(source)} rows>"
