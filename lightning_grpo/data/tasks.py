"""Built-in verifiable tasks: prompts with a known answer, generated from a seed.

A task makes ``TaskItem``s (prompt text + reference answer) deterministically from a
seed and names the built-in reward that scores it. ``arith`` is two-number addition,
"7+12=" -> "19"; ``arith_small`` is the same on operands 0-5, sized so a tiny char-level
policy (hidden 128, 2 layers) gets a fraction of it right after ``warm_start`` (a short
supervised pass that mostly teaches the answer format) and GRPO visibly pushes it higher
in minutes on a CPU (measured numbers in ``ArithTask``).

``render_gsm8k`` turns a GSM8K row (``question`` / ``answer`` with ``#### N``) into
the same ``TaskItem`` shape, for the real-model recipe.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch import nn

from lightning_grpo.data.answers import extract_reference

Split = Literal["train", "val"]

GSM8K_TEMPLATE = "{prompt}\nSolve it step by step. End with a line: #### followed by the final answer as a number.\n"
"""Prompt template of the GSM8K recipe (``PromptDataModule(prompt_template=...)`` takes it by name 'gsm8k')."""
TEMPLATES = {"gsm8k": GSM8K_TEMPLATE}


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
        rng = random.Random(f"{seed}-val" if split == "val" and not self.val_holdout else seed)
        out: list[TaskItem] = []
        while len(out) < n:
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            if self._is_val(a, b) == reserved:
                out.append(TaskItem(f"{a}+{b}=", str(a + b), {"a": a, "b": b}))
        return out

    def _is_val(self, a: int, b: int) -> bool:
        return (a * 31 + b * 17) % self.val_every == 0


def _colors() -> Task:
    from lightning_grpo.data.visual import ColorTask  # images: PIL is imported only when a visual task is used

    return ColorTask()


TASKS: dict[str, Callable[[], Task]] = {
    "arith": ArithTask,
    "arith_small": lambda: ArithTask(max_operand=5, val_holdout=False, name="arith_small"),
    "colors": _colors,
}
"""Registry of built-in tasks by name (``builtin:<name>`` in a data source)."""


def get_task(name: str) -> Task:
    """The built-in task called ``name``; the error lists the known names."""
    if name not in TASKS:
        raise ValueError(f"unknown built-in task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]()


def render_gsm8k(row: Mapping[str, str], template: str = GSM8K_TEMPLATE) -> TaskItem:
    """A GSM8K row (``question``, ``answer`` ending in ``#### N``) as a prompt and its final answer ``N``."""
    return TaskItem(template.format(prompt=row["question"]), extract_reference(row["answer"]))


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt token ids. The one place prompt text becomes tokens, so warm start and rollouts agree."""
    return list(tokenizer(text)["input_ids"])


# -- warm start ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WarmStartResult:
    """What a warm start did."""

    steps: int
    loss: float
    """Mean completion-token loss over the last 10 steps."""
    seconds: float


def warm_start(
    model: nn.Module,
    tokenizer,
    task: Task | str = "arith",
    steps: int = 200,
    seed: int = 0,
    batch_size: int = 32,
    lr: float = 3e-3,
) -> WarmStartResult:
    """Supervised fine-tuning on ``task``'s train split: teach ``answer<eos>`` after each prompt.

    Short on purpose: it fixes the answer format (digits, then EOS) and some of the
    answers, leaving GRPO the rest. The loss covers the completion only. The global RNG
    is left untouched (the draw is forked), and the model's train/eval mode is restored.

    Args:
        model: a causal LM (Hugging Face interface: ``model(input_ids, attention_mask=...).logits``).
        tokenizer: its tokenizer (needs ``eos_token_id`` and ``pad_token_id``).
        task: a ``Task`` or a built-in task name.
        steps: optimizer steps (AdamW, constant ``lr``).
        seed: seeds the item draw and any dropout.
        batch_size: items per step.
        lr: learning rate.
    """
    task = get_task(task) if isinstance(task, str) else task
    items = task.items(steps * batch_size, seed, "train")
    return sft(model, steps, seed, lr,
               lambda step: (*_sft_batch(tokenizer, items[step * batch_size : (step + 1) * batch_size]), {}))


def sft(model: nn.Module, steps: int, seed: int, lr: float, batch_of) -> WarmStartResult:
    """The warm starts' supervised loop: AdamW at a constant ``lr`` over the trainable parameters, the loss on the
    labelled (answer) tokens only. The global RNG is forked and seeded with ``seed``; the model's mode is restored.

    ``batch_of(step)`` gives ``(input_ids, attention_mask, labels, extra model kwargs)`` (a VLM's pixels).
    """
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    was_training, losses, start = model.training, [], time.perf_counter()
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(steps):
            ids, mask, labels, kwargs = batch_of(step)
            logits = model(input_ids=ids, attention_mask=mask, **kwargs).logits[:, :-1]  # [B, T-1, V]
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    model.train(was_training)
    return WarmStartResult(steps, sum(losses[-10:]) / max(len(losses[-10:]), 1), time.perf_counter() - start)


def _sft_batch(tokenizer, items: list[TaskItem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + answer + eos`` rows; labels are -100 except on the answer and EOS."""
    return sft_rows(tokenizer, [encode_prompt(tokenizer, item.text) for item in items], [item.answer for item in items])


def sft_rows(tokenizer, prompts: list[list[int]], answers: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, labels)`` of right-padded ``prompt + answer + eos`` rows, labels -100 except on
    the answer and EOS (the warm starts' supervised rows, text or image prompts alike)."""
    rows, targets = [], []
    for prompt, text in zip(prompts, answers):
        answer = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        targets.append([-100] * len(prompt) + answer)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)  # [B, T]
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(rows), width), dtype=torch.bool)  # [B, T]
    for i, (row, target) in enumerate(zip(rows, targets)):
        ids[i, : len(row)], labels[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), torch.tensor(target), True
    return ids, mask, labels


@torch.no_grad()
def greedy_accuracy(model: nn.Module, tokenizer, items: list[TaskItem], max_new_tokens: int = 8) -> float:
    """Fraction of ``items`` whose greedy completion is exactly ``answer`` followed by EOS."""
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(items), 64):
        chunk = items[i : i + 64]
        prompts = [encode_prompt(tokenizer, it.text) for it in chunk]
        width = max(map(len, prompts))
        # Left padding: every prompt ends at the same column, so generation starts aligned.
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])  # [B, P]
        out = model.generate(
            input_ids=ids,
            attention_mask=ids != tokenizer.pad_token_id,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )[:, width:]  # [B, new]
        for item, completion in zip(chunk, out.tolist()):
            expected = list(tokenizer(item.answer, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
            correct += completion[: len(expected)] == expected
    model.train(was_training)
    return correct / max(len(items), 1)
