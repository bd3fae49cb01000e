"""Warm starts: a short supervised pass that teaches a freshly built tiny policy the answer format.

``warm_start`` (text tasks) and ``warm_start_vision`` (image tasks, a tiny VLM) train ``answer<eos>`` after
each prompt of a built-in task's train split with one loop, ``sft`` (``sft.py``). ``warm_start_folder`` does it to a
folder ``build.py`` just built (the result is cached with the build); ``greedy_accuracy`` measures how
much of a task a policy then gets right. ``arith_tools`` is warm-started on calculator episodes instead
(``tool_warm.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lightning_grpo.data.chat import encode, encode_prompt
from lightning_grpo.data.items import TaskItem
from lightning_grpo.data.tasks import Task, get_task
from lightning_grpo.rollout.base import Prompt
from lightning_grpo.tiny.sft import WarmStartResult, sft
from lightning_grpo.tiny.tool_warm import TOOL_TASK, warm_start_tools
from lightning_grpo.vision import VisionProcessor


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

    def batch_of(step: int):
        rows = items[step * batch_size : (step + 1) * batch_size]
        return (*_sft_batch(tokenizer, rows), {})

    return sft(model, steps, seed, lr, batch_of)


def _sft_batch(
    tokenizer, items: list[TaskItem]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + answer + eos`` rows; labels are -100 except on the answer and EOS."""
    return sft_rows(
        tokenizer,
        [encode_prompt(tokenizer, item.text) for item in items],
        [item.answer for item in items],
    )


def sft_rows(
    tokenizer, prompts: list[list[int]], answers: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, labels)`` of right-padded ``prompt + answer + eos`` rows, labels -100 except on
    the answer and EOS (the warm starts' supervised rows, text or image prompts alike)."""
    rows = []
    targets = []
    for prompt, text in zip(prompts, answers):
        answer = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [
            tokenizer.eos_token_id
        ]
        rows.append(prompt + answer)
        targets.append([-100] * len(prompt) + answer)
    width = max(map(len, rows))
    # [B, T]
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(rows), width), dtype=torch.bool)  # [B, T]
    for i, (row, target) in enumerate(zip(rows, targets)):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(row)] = torch.tensor(target)
        mask[i, : len(row)] = True
    return ids, mask, labels


@torch.no_grad()
def greedy_accuracy(
    model: nn.Module, tokenizer, items: list[TaskItem], max_new_tokens: int = 8
) -> float:
    """Fraction of ``items`` whose greedy completion is exactly ``answer`` followed by EOS."""
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(items), 64):
        chunk = items[i : i + 64]
        prompts = [encode_prompt(tokenizer, it.text) for it in chunk]
        width = max(map(len, prompts))
        # Left padding: every prompt ends at the same column, so generation starts aligned.
        # [B, P]
        ids = torch.tensor(
            [[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts]
        )
        out = model.generate(
            input_ids=ids,
            attention_mask=ids != tokenizer.pad_token_id,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )[:, width:]  # [B, new]
        for item, completion in zip(chunk, out.tolist()):
            expected = list(
                tokenizer(item.answer, add_special_tokens=False)["input_ids"]
            ) + [tokenizer.eos_token_id]
            correct += completion[: len(expected)] == expected
    model.train(was_training)
    return correct / max(len(items), 1)


def warm_start_vision(
    model: nn.Module,
    tokenizer,
    vision,
    task,
    steps: int = 30,
    seed: int = 0,
    batch_size: int = 16,
    lr: float = 3e-3,
) -> WarmStartResult:
    """Supervised pass on ``task``'s train split (prompt with its image -> ``answer<eos>``), like ``warm_start``.

    The global RNG is untouched (forked) and the model's mode restored. The loss covers the answer only.
    """
    task = get_task(task) if isinstance(task, str) else task
    items = task.items(steps * batch_size, seed, "train")

    def batch_of(step: int):
        rows = items[step * batch_size : (step + 1) * batch_size]
        ids, mask, labels, images = _vision_sft_rows(tokenizer, vision, rows)
        return ids, mask, labels, vision.materialize(images, ids).as_kwargs()

    return sft(model, steps, seed, lr, batch_of)


def _vision_sft_rows(tokenizer, vision, items: list[TaskItem]):
    """Right-padded ``prompt (placeholders expanded) + answer + eos`` rows, labels -100 off the answer."""
    prompts = []
    for i, item in enumerate(items):
        ids, text = encode(tokenizer, item.text, item.messages)
        prompts.append(
            vision.expand(Prompt(i, ids, text, images=item.images)).token_ids
        )
    return (
        *sft_rows(tokenizer, prompts, [item.answer for item in items]),
        [item.images for item in items],
    )


def warm_start_folder(
    folder: Path, task: str, steps: int, seed: int, vision: bool = False
) -> None:
    """Supervise the freshly built policy in ``folder`` on ``task`` and save it back (same folder layout).

    ``vision``: the folder holds a vision-language model (trained by ``warm_start_vision``).
    """
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,
    )

    model_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = model_class.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    if vision:
        result = warm_start_vision(
            model,
            tok,
            VisionProcessor.from_pretrained(folder, tok),
            task,
            steps=steps,
            seed=seed,
        )
    elif task == TOOL_TASK:  # calculator episodes, not answers (tool_warm.py)
        result = warm_start_tools(model, tok, task, steps=steps, seed=seed)
    else:
        result = warm_start(model, tok, task, steps=steps, seed=seed)
    print(
        f"warm start of the tiny policy on {task!r}: {result.steps} steps, loss {result.loss:.3f}, "
        f"{result.seconds:.1f} s (cached in {folder.name})",
        flush=True,
    )
    model.save_pretrained(folder, safe_serialization=True)
