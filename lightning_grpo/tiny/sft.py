"""The warm starts' supervised loop (``sft``) and what it reports: shared by the answer warm starts (``warm.py``)
and the tool-episode one (``tool_warm.py``)."""

from __future__ import annotations

import sys
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


class Progress:
    """A warm start's progress with an estimate of the time left: tqdm's bar on a terminal, else a printed line
    every tenth of the steps (a log file gets ten lines, not a bar redrawn per step)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.every = max(steps // 10, 1)
        self.start = time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=steps, desc="warm start", unit="step")

    def update(self, done: int, loss: float) -> None:
        """Report ``done`` steps finished, the last at ``loss``."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            return
        if done % self.every and done != self.steps:
            return
        elapsed = time.perf_counter() - self.start
        left = elapsed / done * (self.steps - done)
        print(
            f"warm start: step {done}/{self.steps}, loss {loss:.3f}, {elapsed:.0f} s, ~{left:.0f} s left",
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def sft(
    model: nn.Module, steps: int, seed: int, lr: float, batch_of, cooldown: int = 0
) -> WarmStartResult:
    """The warm starts' supervised loop: AdamW at a constant ``lr`` over the trainable parameters, the loss on the
    labelled (answer) tokens only. The global RNG is forked and seeded with ``seed``; the model's mode is restored.

    ``cooldown``: the last this many steps decay the lr linearly towards 0 (0: constant to the end). A constant lr
    leaves the last batches' noise in the weights; decaying it settles them on what the data says.

    ``batch_of(step)`` gives ``(input_ids, attention_mask, labels, extra model kwargs)`` (a VLM's pixels).
    """
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0
    )
    was_training = model.training
    losses = []
    start = time.perf_counter()
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        progress = Progress(steps)
        for step in range(steps):
            ids, mask, labels, kwargs = batch_of(step)
            # [B, T-1, V]
            logits = model(input_ids=ids, attention_mask=mask, **kwargs).logits[:, :-1]
            loss = nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (steps - step) / max(cooldown, 1))
            opt.step()
            losses.append(loss.item())
            progress.update(step + 1, losses[-1])
        progress.close()
    model.train(was_training)
    return WarmStartResult(
        steps,
        sum(losses[-10:]) / max(len(losses[-10:]), 1),
        time.perf_counter() - start,
    )
