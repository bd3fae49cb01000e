"""The warm starts' supervised loop (``sft``) and what it reports: shared by the answer warm starts (``warm.py``)
and the tool-episode one (``tool_warm.py``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class WarmStartResult:
    """What a warm start did."""

    steps: int
    loss: float
    """Mean completion-token loss over the last 10 steps."""
    seconds: float


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
