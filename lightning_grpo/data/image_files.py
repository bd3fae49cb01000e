"""Rows that name a missing image file, found before training: refused, or warned about once and skipped when drawn.

``on_bad_record`` decides (``error`` / ``skip``); an unreadable image met later is ``collect/prompts.py``'s.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from lightning_grpo.data.images import missing_files
from lightning_grpo.data.items import TaskItem
from lightning_grpo.data.sources import PromptDataError


def check_image_files(
    items: Sequence[TaskItem], source_name: str, on_bad_record: str
) -> None:
    """A row whose image file is missing: refused before training (``on_bad_record=error``) or warned about
    once, naming the rows (``skip``: each is left out at the loop step that draws it, counted); the warning
    names the caller's line (``PromptDataModule.setup``)."""
    rows = [
        (i, missing)
        for i, it in enumerate(items)
        if (missing := missing_files(it.images))
    ]
    if not rows:
        return
    first = f"row {rows[0][0]}: {rows[0][1][0]}"
    where = f"data.source={source_name}: {len(rows)} of {len(items)} rows name a missing image file"
    if on_bad_record == "error":
        raise PromptDataError(
            f"{where} ({first}); fix the paths, or set data.on_bad_record=skip to train "
            "without those rows (counted in data/bad_records_skipped)"
        )
    warnings.warn(
        f"{where} (rows {[i for i, _ in rows][:10]}; {first}); each is skipped at the loop step "
        "that draws it (data.on_bad_record=skip, counted in data/bad_records_skipped)",
        stacklevel=2,
    )
