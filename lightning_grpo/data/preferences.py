"""Preference pairs for DPO: TRL's preference format in, a ``PreferenceBatch`` of token ids out.

A row has ``prompt``, ``chosen`` and ``rejected`` (column names configurable), either plain strings
(``{"prompt": "3+4=", "chosen": "7", "rejected": "8"}``) or chat messages in TRL's conversational form
(``"prompt": [{"role": "user", ...}]``, ``"chosen": [{"role": "assistant", ...}]``). A conversational row
without a prompt column has it extracted as TRL does: the messages both answers share before they differ.
Sources: a ``.jsonl`` file, a ``datasets.Dataset`` or a list of dicts, a ``datasets`` name or folder (read
with ``datasets`` when installed), or ``builtin:<task>`` (a built-in task's correct answer against a wrong one).

Tokenized like TRL's DPO: the prompt as the policy sees it (a chat prompt through the chat template, with the
assistant turn opened), each answer after it, then EOS; the loss counts the answer tokens only.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_grpo.data.chat import encode_prompt
from lightning_grpo.data.tasks import get_task


class PreferenceDataError(ValueError):
    """A preference source is missing, empty, or has a row without its columns; the message says where and how."""


@dataclass(frozen=True)
class PreferencePair:
    """One preference: the same prompt answered twice, one answer preferred."""

    id: int
    """Position in the source (a deterministic id)."""
    prompt: str | list[dict]
    chosen: str | list[dict]
    rejected: str | list[dict]


# -- reading ---------------------------------------------------------------------------------------------------------
def load_pairs(
    source: Any,
    *,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    split: str = "train",
    size: int = 10_000,
    seed: int = 0,
) -> list[PreferencePair]:
    """The pairs of ``source`` (see the module docstring); raises ``PreferenceDataError`` naming what is wrong.

    Args:
        source: ``builtin:<task>``, a ``.jsonl`` path, a ``datasets`` name or folder, or a ``datasets.Dataset`` /
            list of dicts.
        prompt_key, chosen_key, rejected_key: the columns (TRL's names by default).
        split: ``train`` or ``val`` of a built-in task; the split of a ``datasets`` name or folder.
        size: pairs drawn from a built-in task.
        seed: seed of a built-in task's draw.
    """
    if isinstance(source, str) and source.startswith("builtin:"):
        pairs = builtin_pairs(source.split(":", 1)[1], split, size, seed)
    else:
        rows, where = _rows(source, split)
        pairs = [
            _pair(row, i, where(i), prompt_key, chosen_key, rejected_key)
            for i, row in enumerate(rows)
        ]
    if not pairs:
        raise PreferenceDataError(f"source={source!r}: no preference pairs ({split})")
    return pairs


def _rows(source: Any, split: str) -> tuple[Sequence[Mapping], Any]:
    if not isinstance(source, (str, Path)):
        if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
            return source, lambda i: f"row {i}"
        raise PreferenceDataError(
            f"source={source!r}: give a .jsonl path, a datasets name or folder, "
            "'builtin:<task>', or a datasets.Dataset / list of dicts"
        )
    path = Path(source).expanduser()
    if path.suffix in (".jsonl", ".json") and path.is_file():
        return _read_jsonl(path), lambda i: f"{path} row {i}"
    try:
        import datasets
    except ImportError as err:
        raise PreferenceDataError(
            f"source={str(source)!r}: not a .jsonl file; reading other sources needs the "
            "`datasets` package (pip install datasets)"
        ) from err
    rows = (
        datasets.load_from_disk(str(path))
        if path.is_dir()
        else datasets.load_dataset(str(source), split=split)
    )
    if isinstance(rows, datasets.DatasetDict):
        rows = rows[split]
    return rows, lambda i: f"{source} ({split}) row {i}"


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise PreferenceDataError(
                        f"{path}:{lineno}: not valid JSON ({err.msg}); one object per line"
                    ) from err
    return rows


def _pair(
    row: Any, i: int, where: str, prompt_key: str, chosen_key: str, rejected_key: str
) -> PreferencePair:
    if not isinstance(row, Mapping):
        raise PreferenceDataError(
            f"{where}: a row must be an object with named columns, got {type(row).__name__}"
        )
    missing = [k for k in (chosen_key, rejected_key) if k not in row]
    if missing:
        raise PreferenceDataError(
            f"{where}: no column {' or '.join(map(repr, missing))}; the row has columns {sorted(row)}. A preference "
            f"pair needs {chosen_key!r} and {rejected_key!r} (TRL's preference format): set chosen_key / "
            "rejected_key (CLI: --data.init_args.chosen_key) to the columns holding the two answers"
        )
    chosen = row[chosen_key]
    rejected = row[rejected_key]
    if prompt_key in row:
        return PreferencePair(i, row[prompt_key], chosen, rejected)
    # implicit prompt: the shared leading messages
    if _is_messages(chosen) and _is_messages(rejected):
        shared = 0
        while (
            shared < min(len(chosen), len(rejected)) - 1
            and chosen[shared] == rejected[shared]
        ):
            shared += 1
        if shared:
            return PreferencePair(
                i, list(chosen[:shared]), list(chosen[shared:]), list(rejected[shared:])
            )
    raise PreferenceDataError(
        f"{where}: no column {prompt_key!r}; the row has columns {sorted(row)}. Set prompt_key to the column holding "
        "the prompt (a conversational pair without one needs chosen/rejected that share their first messages)"
    )


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, Mapping) and "role" in m for m in value)
    )


def builtin_pairs(task: str, split: str, size: int, seed: int) -> list[PreferencePair]:
    """A built-in task's prompts with the correct answer chosen and a near miss (answer +-1..3) rejected.

    Every (prompt, wrong answer) belongs to one split by a fixed hash (1 in 5 to ``val``), so a ``val`` pair
    never occurs in ``train``; its prompt and correct answer do, so the held-out accuracy measures whether the
    policy learned to prefer the right answer, not which pairs it saw. ``val`` pairs are distinct.
    """
    t = get_task(task)
    # every prompt the task has, in both
    items = t.items(6 * size, seed, "train") + t.items(size, seed, "val")
    rng = random.Random(seed + (split == "val"))
    pairs = []
    seen = set()
    for item in items:
        wrong = int(item.answer) + rng.choice((-3, -2, -1, 1, 2, 3))
        if wrong < 0 or (_stable_hash(item.text, wrong) % 5 == 0) != (split == "val"):
            continue
        if split == "val" and (item.text, wrong) in seen:
            continue
        seen.add((item.text, wrong))
        pairs.append(PreferencePair(len(pairs), item.text, item.answer, str(wrong)))
        if len(pairs) == size:
            break
    return pairs


def _stable_hash(text: str, wrong: int) -> int:
    """The same in every process (``hash`` of a str is salted per interpreter)."""
    return sum(ord(c) * 31**k for k, c in enumerate(text)) + 17 * wrong


# -- tokenizing ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PreferenceBatch:
    """Pairs as token ids (this rank's share), each side packed from position 0 and right-padded.

    Attributes:
        chosen_ids, rejected_ids: ``[N, T_c]``, ``[N, T_r]`` prompt + answer + EOS.
        chosen_attention, rejected_attention: bool, True on real tokens.
        chosen_mask, rejected_mask: bool, True exactly on the answer tokens (the ones the loss counts).
        pair_ids: ``[N]`` stream position of each pair.
        ref_chosen, ref_rejected: ``[N]`` summed reference logprobs of each answer (set by the reference pass), or None.
    """

    chosen_ids: Tensor
    chosen_attention: Tensor
    chosen_mask: Tensor
    rejected_ids: Tensor
    rejected_attention: Tensor
    rejected_mask: Tensor
    pair_ids: Tensor
    ref_chosen: Tensor | None = None
    ref_rejected: Tensor | None = None

    def __len__(self) -> int:
        return self.chosen_ids.shape[0]

    def select(self, rows: Tensor | slice) -> PreferenceBatch:
        """Rows ``rows``, each side trimmed to its longest real sequence (exact: trailing padding is never read)."""
        picked = {
            f.name: None
            if getattr(self, f.name) is None
            else getattr(self, f.name)[rows]
            for f in fields(self)
        }
        for side in ("chosen", "rejected"):
            width = max(
                int(picked[f"{side}_attention"].sum(-1).max())
                if len(picked["pair_ids"])
                else 0,
                2,
            )
            for name in ("ids", "attention", "mask"):
                picked[f"{side}_{name}"] = picked[f"{side}_{name}"][:, :width]
        return PreferenceBatch(**picked)

    def to(self, device) -> PreferenceBatch:
        return replace(
            self,
            **{
                f.name: None
                if getattr(self, f.name) is None
                else getattr(self, f.name).to(device)
                for f in fields(self)
            },
        )

    def sequences(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(ids, attention, mask)``, each ``[2N, T]``: chosen rows, then rejected rows (one forward for both)."""
        width = max(self.chosen_ids.shape[1], self.rejected_ids.shape[1])

        # right-padded with zeros/False: never counted, never attended
        def both(a: Tensor, b: Tensor) -> Tensor:
            return torch.cat(
                [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in (a, b)]
            )

        return (
            both(self.chosen_ids, self.rejected_ids),
            both(self.chosen_attention, self.rejected_attention),
            both(self.chosen_mask, self.rejected_mask),
        )


def encode_pairs(
    pairs: Sequence[PreferencePair], tokenizer, max_length: int | None = None
) -> PreferenceBatch:
    """Token ids of ``pairs`` (see the module docstring); an answer past ``max_length`` tokens is cut at the end."""
    sides = {"chosen": [], "rejected": []}
    for pair in pairs:
        prompt, answers = _render(pair, tokenizer)
        if max_length is not None and len(prompt) >= max_length:
            raise PreferenceDataError(
                f"pair {pair.id}: its prompt has {len(prompt)} tokens, not fewer than "
                f"max_length={max_length}; raise dpo.max_length or shorten the prompt"
            )
        for side, answer in zip(sides, answers):
            ids = list(tokenizer(answer, add_special_tokens=False)["input_ids"]) + [
                tokenizer.eos_token_id
            ]
            sides[side].append(
                (
                    prompt,
                    ids[: None if max_length is None else max_length - len(prompt)],
                )
            )
    packed = {side: _pack(rows, tokenizer.pad_token_id) for side, rows in sides.items()}
    return PreferenceBatch(
        *packed["chosen"],
        *packed["rejected"],
        pair_ids=torch.tensor([p.id for p in pairs], dtype=torch.long),
    )


def _render(pair: PreferencePair, tokenizer) -> tuple[list[int], tuple[str, str]]:
    """Prompt token ids and the two answers as text after it."""
    if isinstance(pair.prompt, str):
        if not (isinstance(pair.chosen, str) and isinstance(pair.rejected, str)):
            raise PreferenceDataError(
                f"pair {pair.id}: a plain-string prompt needs plain-string answers"
            )
        return encode_prompt(tokenizer, pair.prompt), (pair.chosen, pair.rejected)
    if not getattr(tokenizer, "chat_template", None):
        raise PreferenceDataError(
            f"pair {pair.id}: chat messages need a tokenizer with a chat template; use a chat "
            "model's tokenizer, or plain-string pairs"
        )
    prompt = tokenizer.apply_chat_template(
        pair.prompt, add_generation_prompt=True, tokenize=False
    )
    answers = []
    for answer in (pair.chosen, pair.rejected):
        turn = (
            [{"role": "assistant", "content": answer}]
            if isinstance(answer, str)
            else list(answer)
        )
        full = tokenizer.apply_chat_template(list(pair.prompt) + turn, tokenize=False)
        if not full.startswith(prompt):
            raise PreferenceDataError(
                f"pair {pair.id}: the chat template renders prompt + answer not starting with "
                "the rendered prompt; the answer tokens cannot be told apart"
            )
        answers.append(full[len(prompt) :])
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"]), (
        answers[0],
        answers[1],
    )


def _pack(
    rows: list[tuple[list[int], list[int]]], pad_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    width = max(max(len(p) + len(a) for p, a in rows), 2)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [N, T]
    attention = torch.zeros(len(rows), width, dtype=torch.bool)  # [N, T]
    mask = torch.zeros(len(rows), width, dtype=torch.bool)  # [N, T]
    for i, (prompt, answer) in enumerate(rows):
        n = len(prompt) + len(answer)
        ids[i, :n] = torch.tensor(prompt + answer, dtype=torch.long)
        attention[i, :n] = True
        mask[i, len(prompt) : n] = True
    return ids, attention, mask
