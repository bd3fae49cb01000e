"""Prompt sources -> ``TaskItem`` lists: files and datasets through ``datasets``, or ``builtin:<task>``.

A source is ``builtin:<task>``; a local file (``.jsonl``, ``.json``, ``.parquet``, ``.csv``, ``.arrow``);
a local folder (``Dataset.save_to_disk`` output, or a folder of data files like a Hub dataset repo);
a ``datasets`` Hub id (``openai/gsm8k`` with ``subset="main"``), read from the local datasets cache when
offline (``HF_HUB_OFFLINE=1``); or, from Python, a ``datasets.Dataset`` / list of dicts.

A row's prompt is a string, or a list of chat messages (TRL's conversational format). Every other
column travels with the prompt (``TaskItem.meta``) to the reward functions. Every problem is
reported with where it is (file and line, or row index), what is wrong and how to fix it, before
any model trains.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_grpo.data.chat import is_messages, with_system
from lightning_grpo.data.images import (
    as_refs,
    count_image_parts,
    split_inline_images,
    text_of,
    with_image_parts,
)
from lightning_grpo.data.items import Split, TaskItem
from lightning_grpo.data.tasks import TEMPLATES, get_task

FILE_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
"""File suffix -> the ``datasets`` builder that reads it."""
DATASET_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
"""What a ``datasets`` Hub id looks like (``name`` or ``org/name``)."""


class PromptDataError(ValueError):
    """A prompt source is missing, empty, or has a malformed row; the message says where and how to fix it."""


def load_items(
    source: Any,
    *,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    prompt_template: str | None = None,
    system_prompt: str | None = None,
    chat: bool = False,
    size: int = 10_000,
    seed: int = 0,
    split: Split = "train",
    dataset_split: str = "train",
    subset: str | None = None,
    image_key: str = "images",
) -> list[TaskItem]:
    """The items of ``source``; raises ``PromptDataError`` on a missing column, a bad row or an empty result.

    Args:
        source: see the module docstring.
        prompt_key: column holding the prompt (a string, or chat messages).
        answer_key: column holding the reference answer; None when the rows have none.
        prompt_template: a name in ``tasks.TEMPLATES`` or a format string with ``{prompt}``, applied to string
            prompts; None = as is.
        system_prompt: a system message put first in chat prompts; prepended (plus a newline) to plain ones.
        chat: wrap string prompts as one user message, so they too go through the chat template.
        size: items drawn from a built-in task (files and datasets give all their rows).
        seed: seed of a built-in task's draw.
        split: ``"train"`` or ``"val"`` of a built-in task (the two are kept disjoint).
        dataset_split: split of a ``datasets`` id or folder (``train``, ``test``, ...); a single file has one.
        subset: configuration (subset) of a ``datasets`` id, e.g. ``main`` for ``openai/gsm8k``.
        image_key: column of the prompt's images (paths, bytes, PIL images or a ``datasets`` Image column; one or
            a list); ``image`` is read when this column is absent. Kept as references (``data/images.py``).
    """
    template = resolve_template(prompt_template)
    if isinstance(source, str) and source.startswith("builtin:"):
        items = get_task(source.split(":", 1)[1]).items(size, seed, split)
    else:
        rows, where = read_rows(source, dataset_split, subset)
        _check_columns(rows, prompt_key, answer_key, _name(source))
        items = [
            _row_item(row, prompt_key, answer_key, where, i, image_key)
            for i, row in enumerate(rows)
        ]
    if not items:
        raise PromptDataError(
            f"source={_name(source)}: the {split} prompt set is empty; it needs at least one prompt"
        )
    return [_shape(it, template, system_prompt, chat) for it in items]


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


def _shape(
    item: TaskItem, template: str, system_prompt: str | None, chat: bool
) -> TaskItem:
    """Template a string prompt; wrap it as chat when asked; put the system prompt first."""
    if item.messages is not None:
        return replace(item, messages=with_system(item.messages, system_prompt))
    text = template.format(prompt=item.text)
    # a text prompt with images is one user message with image parts (the chat template places them)
    if item.images:
        return replace(
            item,
            text=text,
            messages=with_system(
                with_image_parts(text, len(item.images)), system_prompt
            ),
        )
    if chat:
        return replace(
            item,
            text=text,
            messages=with_system([{"role": "user", "content": text}], system_prompt),
        )
    return replace(
        item, text=text if system_prompt is None else f"{system_prompt}\n{text}"
    )


# -- reading -----------------------------------------------------------------------------------------------------


def read_rows(
    source: Any, split: str = "train", subset: str | None = None
) -> tuple[Any, Callable[[int], str]]:
    """``(rows, where)``: the source's rows (a ``datasets.Dataset`` or list of mappings) and ``where(i)``, row i's
    location for error messages."""
    if not isinstance(source, (str, Path)):
        if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
            return source, lambda i: f"dataset row {i}"
        raise PromptDataError(
            f"source={source!r}: give 'builtin:<task>', a file, a folder, a datasets id, or a datasets.Dataset / "
            "list of dicts"
        )
    path = Path(source).expanduser()
    if path.is_file():
        return _read_file(path)
    if path.is_dir():
        return _read_folder(path, split, subset), lambda i: f"{path} ({split}) row {i}"
    if path.suffix in FILE_BUILDERS or not DATASET_ID.match(str(source)):
        raise PromptDataError(
            f"source={str(source)!r}: not an existing file or folder (relative paths start at the working folder "
            f"{Path.cwd()}); give a {'/'.join(FILE_BUILDERS)} file, a folder, a datasets id or 'builtin:<task>'"
        )
    return _load_dataset(
        str(source), split, subset
    ), lambda i: f"{source} ({split}) row {i}"


def _read_file(path: Path) -> tuple[Any, Callable[[int], str]]:
    builder = FILE_BUILDERS.get(path.suffix)
    if builder is None:
        raise PromptDataError(
            f"source={str(path)!r}: unknown file type {path.suffix!r}; use one of {', '.join(FILE_BUILDERS)}"
        )
    import datasets

    if builder == "json":
        _check_utf8(path)
    try:
        rows = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as err:  # noqa: BLE001 - diagnosed below with our own line-by-line reader
        if builder != "json":
            raise PromptDataError(
                f"source={str(path)!r}: datasets could not read it ({type(err).__name__}: {err})"
            )
        # names the bad line; or reads rows pyarrow refused (mixed column types)
        rows = _read_json_lines(path)
    lines = _line_numbers(path) if path.suffix == ".jsonl" else None
    return rows, lambda i: f"{path}:{lines()[i]}" if lines else f"{path} row {i}"


def _read_json_lines(path: Path) -> list[dict]:
    rows = []
    # bytes: a line that is not UTF-8 is named, not a UnicodeDecodeError from the reader
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            line = _utf8_line(path, lineno, raw)
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise PromptDataError(
                    f"{path}:{lineno}: not valid JSON ({err.msg}); each line must be one JSON object"
                ) from err
    return rows


def _utf8_line(path: Path, lineno: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PromptDataError(
            f"{path}:{lineno}: not UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1}); "
            "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def _check_utf8(path: Path) -> None:
    """pyarrow reads a JSON file with bytes that are not UTF-8 and fails later, at a row, naming neither file nor
    line: read it once here (one pass over the bytes, ~1 GB/s) to name both."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            _utf8_line(path, lineno, raw)


def _line_numbers(path: Path) -> Callable[[], list[int]]:
    """Lazily, the line number of each row of a JSON Lines file (blank lines hold no row)."""
    cache: list[list[int]] = []

    def lines() -> list[int]:
        if not cache:
            with path.open("rb") as fh:  # bytes, as _read_json_lines reads them
                cache.append([n for n, line in enumerate(fh, start=1) if line.strip()])
        return cache[0]

    return lines


def _read_folder(path: Path, split: str, subset: str | None) -> Any:
    import datasets

    # Dataset.save_to_disk output
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise PromptDataError(
                    f"data.split={split!r}: {path} has the splits {sorted(loaded)}"
                )
            return loaded[split]
        return loaded
    return _load_dataset(str(path), split, subset)


def _load_dataset(name: str, split: str, subset: str | None) -> Any:
    """``datasets.load_dataset(name, subset, split=split)`` with its failures turned into fixes."""
    import datasets

    try:
        return datasets.load_dataset(name, subset, split=split)
    except ConnectionError:
        args = f"{name!r}" + (f", {subset!r}" if subset else "")
        raise PromptDataError(
            f"data.source={name!r}: not a local file or folder, and the datasets id is not in the local datasets "
            f"cache ({datasets.config.HF_DATASETS_CACHE}) while offline (HF_HUB_OFFLINE=1 or no network). Fix: "
            f"load it once where there is network (datasets.load_dataset({args})) and point HF_HOME at that "
            "cache, or give a local .jsonl/.parquet file or a save_to_disk folder"
        ) from None  # datasets' chained "Couldn't reach ... on the Hub" only repeats it
    except ValueError as err:
        knob = (
            f"data.split={split!r}"
            if "split" in str(err).lower()
            else f"data.subset={subset!r}"
        )
        raise PromptDataError(f"{knob} of data.source={name!r}: {err}") from err
    except Exception as err:
        raise PromptDataError(
            f"data.source={name!r}: datasets could not load it ({type(err).__name__}: {err})"
        ) from err


# -- rows -> items -----------------------------------------------------------------------------------------------


def _check_columns(
    rows: Any, prompt_key: str, answer_key: str | None, name: str
) -> None:
    """A dataset with named columns must have the configured ones (rows of a list are checked one by one)."""
    columns = getattr(rows, "column_names", None)
    if columns is None:
        return
    if prompt_key not in columns:
        raise PromptDataError(
            f"data.prompt_key={prompt_key!r}: {name} has no such column (its columns: {columns}). Set "
            "--data.prompt_key to the column holding the prompt (text or chat messages)"
        )
    if answer_key is not None and answer_key not in columns:
        raise PromptDataError(
            f"data.answer_key={answer_key!r}: {name} has no such column (its columns: {columns}). Set "
            "--data.answer_key to the column holding the reference answer, or to null if the prompts have none"
        )


def _row_item(
    row: Any,
    prompt_key: str,
    answer_key: str | None,
    where: Callable[[int], str],
    i: int,
    image_key: str = "images",
) -> TaskItem:
    if not isinstance(row, Mapping):
        raise PromptDataError(
            f"{where(i)}: a row must be an object with named columns, got {type(row).__name__}"
        )
    present = sorted(k for k, v in row.items() if v is not None)
    if row.get(prompt_key) is None:
        raise PromptDataError(
            f"{where(i)}: no key {prompt_key!r} (the row has {present}). Set prompt_key "
            f"(CLI: --data.prompt_key) to the column holding the prompt"
        )
    if answer_key is not None and answer_key not in row:
        raise PromptDataError(
            f"{where(i)}: no key {answer_key!r} (the row has {present}). Set answer_key (CLI: --data.answer_key) to "
            "the column holding the reference answer, or to null if the prompts have none"
        )
    prompt = row[prompt_key]
    answer = (
        None if answer_key is None or row[answer_key] is None else str(row[answer_key])
    )
    key = image_key if image_key in row or "image" not in row else "image"
    try:
        images = as_refs(row.get(key))
    except TypeError as err:
        raise PromptDataError(
            f"{where(i)}: column {key!r}: {err}; give paths, bytes or PIL images"
        ) from None
    # images travel as references, not meta
    meta = {k: v for k, v in row.items() if k not in (prompt_key, key)}
    if isinstance(prompt, str) and prompt:
        # with images: made a chat message in _shape
        return TaskItem(prompt, answer, meta, None, images)
    if is_messages(prompt):
        # datasets pads missing keys
        messages = [{k: v for k, v in m.items() if v is not None} for m in prompt]
        messages, inline = split_inline_images(messages)
        images = inline + images
        if count_image_parts(messages) != len(images):
            raise PromptDataError(
                f"{where(i)}: the messages hold {count_image_parts(messages)} image parts ({{'type': 'image'}}) but "
                f"the row has {len(images)} images (column {key!r} plus inline ones); give one image per part"
            )
        return TaskItem(text_of(messages), answer, meta, messages, images)
    raise PromptDataError(
        f"{where(i)}: {prompt_key!r} must be a non-empty string or a list of chat messages "
        f"[{{'role': ..., 'content': ...}}], got {prompt!r:.80}"
    )


def _name(source: Any) -> str:
    return (
        repr(str(source))
        if isinstance(source, (str, Path))
        else f"<{type(source).__name__} of {len(source)} rows>"
    )
