"""Built-in verifiable tasks: prompts with a known answer, generated from a seed.

A task makes ``TaskItem``s (prompt text + reference answer) deterministically from a
seed and names the built-in reward that scores it. ``arith`` is two-number addition,
"7+12=" -> "19"; ``arith_small`` is the same on operands 0-5, sized so a tiny char-level
policy (hidden 128, 2 layers) gets a fraction of it right after ``tiny.warm.warm_start`` (a
short supervised pass that mostly teaches the answer format) and GRPO visibly pushes it higher
in minutes on a CPU (measured numbers in ``ArithTask``). ``colors`` is ``visual.py``'s image task.

``render_gsm8k`` turns a GSM8K row (``question`` / ``answer`` with ``#### N``) into
the same ``TaskItem`` shape, for the real-model recipe.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from lightning_grpo.data.answers import extract_reference
from lightning_grpo.data.items import Split, TaskItem
from lightning_grpo.data.visual import ColorTask

GSM8K_TEMPLATE = "{prompt}\nSolve it step by step. End with a line: #### followed by the final answer as a number.\n"
"""Prompt template of the GSM8K recipe (``PromptDataModule(prompt_template=...)`` takes it by name 'gsm8k')."""
TEMPLATES = {"gsm8k": GSM8K_TEMPLATE}


class Task(Protocol):
    """What the data module and ``warm_start`` need from a built-in task."""

    name: str
    reward: str
    """Name of the built-in reward function that scores this task (see ``rewards.BUILTINS``)."""

    def items(self, n: int, seed: int, split: Split = "train") -> list[TaskItem]:
        """``n`` items drawn deterministically from ``seed``; ``"val"`` items never occur in ``"train"``."""
        ...


@dataclass(frozen=True)
class ArithTask:
    """Addition of two integers in ``[0, max_operand]``: prompt ``"a+b="``, answer ``str(a + b)``.

    Each (a, b) pair belongs to one split by a fixed hash; about 1 pair in ``val_every`` is reserved.
    With ``val_holdout`` the ``"val"`` split is those reserved pairs, so it measures generalization
    rather than recall. Without it the reserved pairs are simply not used, and ``"val"`` is an
    independent draw (its own seed stream) from the training pairs: validation then measures how well
    the policy knows the training distribution. ``arith_small`` does that: its 36 pairs held out by
    hash left 4 sums that a policy learning facts never gets right (``val/reward`` stayed 0.0 at every
    validation), while a draw of 64 prompts from its 32 training pairs moves in steps of 1/64.

    Sizing, measured on 2 shared CPU cores with the tiny policy (hidden 128, 2 layers), GRPO
    being an on-policy loop of 8 prompts x 8 completions, AdamW, temperature 1:

    - ``arith`` (operands 0-19, 400 pairs): 200 warm-start steps get ~10% right greedily, 400-600
      steps 10-25%. With operands 0-7 or 0-9 the sampled reward already stayed flat over 100-250 GRPO
      steps (lr 3e-4 to 1e-3): too many distinct facts for sparse rewards in minutes; 400 are more.
    - ``arith_small`` (operands 0-5, 36 pairs, 32 for training): 30 warm-start steps (3-15 s) get
      30-48% right greedily, 20-23% sampled (seeds 0-2); 100 GRPO steps at lr 5e-4 then raised the
      sampled reward from 0.20 to 0.52 (one run, 80 s). The task for a run that must visibly learn.
      The quickstart's validation (greedy, 64 prompts drawn from the training pairs, every 10 loop steps)
      went 0.34, 0.41, 0.44, 0.42, 0.45, 0.44, 0.63, 0.58 over its 80 loop steps (one run).
    """

    max_operand: int = 19
    """Largest operand."""
    val_every: int = 10
    """One pair in this many (by hash) is reserved and never trained on."""
    val_holdout: bool = True
    """``"val"`` = the reserved pairs (generalization); False = a separate draw of the training pairs."""
    name: str = "arith"
    reward: str = "arith"

    def items(self, n: int, seed: int, split: Split = "train") -> list[TaskItem]:
        reserved = split == "val" and self.val_holdout
        # A draw of the training pairs for validation gets its own stream, so it is not the training draw.
        rng = random.Random(
            f"{seed}-val" if split == "val" and not self.val_holdout else seed
        )
        out: list[TaskItem] = []
        while len(out) < n:
            a = rng.randint(0, self.max_operand)
            b = rng.randint(0, self.max_operand)
            if self._is_val(a, b) == reserved:
                out.append(TaskItem(f"{a}+{b}=", str(a + b), {"a": a, "b": b}))
        return out

    def _is_val(self, a: int, b: int) -> bool:
        return (a * 31 + b * 17) % self.val_every == 0


TASKS: dict[str, Callable[[], Task]] = {
    "arith": ArithTask,
    "arith_small": functools.partial(
        ArithTask, max_operand=5, val_holdout=False, name="arith_small"
    ),
    # operands too large to add in one's head (or in a tiny policy's weights): the calculator environment's task
    "arith_tools": functools.partial(
        ArithTask, max_operand=999, val_holdout=False, name="arith_tools"
    ),
    "colors": ColorTask,  # images: PIL is imported only when a visual task draws items
}
"""Registry of built-in tasks by name (``builtin:<name>`` in a data source)."""


def get_task(name: str) -> Task:
    """The built-in task called ``name``; the error lists the known names."""
    if name not in TASKS:
        raise ValueError(
            f"unknown built-in task {name!r}; known tasks: {', '.join(sorted(TASKS))}"
        )
    return TASKS[name]()


def render_gsm8k(row: Mapping[str, str], template: str = GSM8K_TEMPLATE) -> TaskItem:
    """A GSM8K row (``question``, ``answer`` ending in ``#### N``) as a prompt and its final answer ``N``."""
    return TaskItem(
        template.format(prompt=row["question"]), extract_reference(row["answer"])
    )
