"""``TaskItem``, one prompt with its reference answer, and ``Split``, the part of a task it is drawn from.

What every prompt source makes (the built-in tasks, ``visual.py``'s image task, ``sources.py``'s files and
Hub datasets) and what ``chat.py``, ``prompts.py`` and the warm starts read. Kept apart from the tasks so
that each of those imports this record, never one another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Split = Literal["train", "val"]


@dataclass(frozen=True)
class TaskItem:
    """One prompt of a task with its reference answer."""

    text: str
    """Prompt text, exactly as the policy sees it; for a chat prompt, its last message's content (for display)."""
    answer: str | None
    """Reference answer the reward checks against; None when the source has none."""
    meta: dict = field(default_factory=dict)
    """The source row's other columns (the raw answer column included): reward functions receive them."""
    messages: list[dict] | None = None
    """Chat messages of a conversational prompt (rendered by the tokenizer's chat template); None = plain text."""
    images: tuple = ()
    """Image references of the prompt, in the order of its ``{"type": "image"}`` parts (``data/images.py``)."""
