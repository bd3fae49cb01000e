"""A toy float64 causal language model and an ``Updater`` around it: the unit tier's model (tests/update,
tests/objectives). No Lightning, no transformers: a few lines of ``nn.Module``, a plain optimizer and the GRPO
objective, exactly as docs/update.md draws one update."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_grpo.objectives import PolicyView
from lightning_grpo.objectives.grpo import GRPOObjective
from lightning_grpo.timing import StepTimer
from lightning_grpo.update import AheadPass, Needs, Split, Updater

VOCAB = 80
"""``helpers.synthetic_batch`` draws token ids below 80."""
UNEQUAL = [1, 12, 3, 20, 2, 7, 15, 4]
"""Completion lengths whose chunk token counts differ a lot: a per-chunk mean is visibly wrong."""
LENS = [3, 9, 1, 6, 12, 2, 5, 8, 4, 10, 7, 11, 6, 2, 9, 3]
"""16 unequal completions."""


class ToyLM(nn.Module):
    """A causal toy language model in float64: position t reads the mean of the embeddings up to t.

    Right padding never reaches an earlier position, so a row scores the same in any chunk."""

    def __init__(self, seed: int = 0, width: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width, dtype=torch.float64)
        self.mix = nn.Linear(width, width, dtype=torch.float64)
        self.head = nn.Linear(width, VOCAB, dtype=torch.float64)
        self.drop = nn.Dropout(dropout)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).cumsum(1)  # [B, T, W]
        steps = torch.arange(1, ids.shape[1] + 1, dtype=h.dtype)
        h = h / steps[:, None]  # causal mean
        return self.head(self.drop(torch.tanh(self.mix(h))))  # [B, T, V]


def score(model: nn.Module, chunk) -> torch.Tensor:
    """``[B, T-1]`` logprob of each next token under ``model``."""
    logits = model(chunk.input_ids)[:, :-1]
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, chunk.input_ids[:, 1:, None])[..., 0]


def call(fn, *args):
    return fn(*args)


@dataclass
class Toy:
    """A toy model, its objective and an attached Updater (plain torch, SGD unless told)."""

    model: ToyLM
    updater: Updater
    objective: GRPOObjective
    timer: StepTimer = field(default_factory=StepTimer)

    def forward_chunk(self, chunk, old):
        view = PolicyView(model=self.model, temperature=1.0, logprobs=functools.partial(score, self.model),
                          reference=None, call=call)
        return self.objective.chunk_loss(chunk, view, old)

    @property
    def loop(self):
        return self.updater.loop

    @property
    def accumulator(self):
        return self.updater.loop.accumulator


def make_toy(split: Split = Split(), needs: Needs = Needs(), lr: float = 0.1, seed: int = 0,
             max_grad_norm: float = 0.0, objective: GRPOObjective | None = None, adam: bool = False,
             dropout: float = 0.0, skip_first_mini: bool = True) -> Toy:
    """A fresh toy model (``seed``) with an Updater over it: identical seeds give identical starts."""
    model = ToyLM(seed, dropout=dropout).train()
    toy = Toy(model, None, objective or GRPOObjective(epsilon=0.2))
    ahead = AheadPass(model, functools.partial(score, model), skip_first_mini=skip_first_mini)
    toy.updater = Updater(model, toy.forward_chunk, split, needs, ahead=ahead, max_grad_norm=max_grad_norm,
                          timer=toy.timer)
    if adam:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    toy.updater.attach(optimizer)
    return toy


def poison(toy: Toy, calls: set[int]) -> list[int]:
    """Make the loss of the given forward calls (counted over the toy's life, in walk order) NaN; returns the count."""
    count = [0]

    def forward_chunk(chunk, old):
        loss, denom, stats = toy.forward_chunk(chunk, old)
        k = count[0]
        count[0] += 1
        return (loss * float("nan") if k in calls else loss), denom, stats

    toy.loop.forward_chunk = forward_chunk
    return count


def toy_logprobs(model: ToyLM, ids) -> list[float]:
    """``log p(ids[i] | ids[:i])`` under a toy model: the trainer's side of a stub server's probe."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([list(ids)]))[0, :-1], -1)
    return logp.gather(-1, torch.tensor(list(ids)[1:])[:, None])[:, 0].tolist()


def ids_text(ids) -> str:
    """The stub server's text of token ids: the ids, space-separated."""
    return " ".join(map(str, ids))
