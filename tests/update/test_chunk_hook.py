"""A per-chunk hook (``update/records.py`` ``ChunkHook``) that is not MoE, driven by a bare Updater on a toy model."""

import contextlib
import inspect
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from helpers import output_norm_capture, synthetic_batch
from torch import nn

from lightning_grpo.config import GRPOConfig
from lightning_grpo.routing import RoutingReplay
from lightning_grpo.update import AheadPass, ChunkHook, HookNeeds, Needs, Split, Updater, batch_needs

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier

LENS = [3, 9, 1, 6, 12, 2, 5, 8]  # 8 unequal completions: n_mini=2 x n_micro=2 chunks of 2 rows
VOCAB = 80


class Toy(nn.Module):
    """Embedding -> linear head: a next-token model small enough to reason about."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))  # [B, T, V]


def score(model: Toy, chunk):
    """``[B, T-1]`` logprobs of each next token."""
    logits = model(chunk.input_ids)[:, :-1]  # [B, T-1, V]
    return logits.log_softmax(-1).gather(-1, chunk.input_ids[:, 1:, None]).squeeze(-1)


@dataclass(frozen=True)
class ToyStats:
    REDUCE: ClassVar[dict] = {}
    loss: torch.Tensor
    denom: torch.Tensor


def forward_chunk(model, events):
    """A policy-gradient loss over completion tokens, with its token count as the divisor."""

    def run(chunk, old):
        events.append("forward")
        mask = chunk.completion_mask[:, 1:]  # [B, T-1]
        denom = mask.sum().double()
        loss = -(score(model, chunk) * chunk.advantages[:, None] * mask).sum() / denom.clamp(min=1)
        return loss, denom, ToyStats(loss.detach(), denom)

    return run


class EmbedNorm:
    """Records the norm of each token's embedding (``[T]`` per row); reads it back in every training chunk."""

    name, token_dim = "embed_norm", 0

    def __init__(self, model: Toy, events: list, needs: HookNeeds) -> None:
        self.embed = model.embed
        self.events = events
        self.declared = needs
        self.records = None
        self.begun = []  # (batch, plan, records) per update
        self.replayed = []  # what the probe's re-score replayed
        self.read = []  # per training chunk: its laid-out record

    def needs(self, several_chunks: bool) -> HookNeeds:
        return self.declared

    def capture(self):
        return output_norm_capture(self.embed)  # cap.value: [B, T] once the forward ran

    def split(self, value, rows, lengths):
        return [value[i, : lengths[r]].clone() for i, r in enumerate(rows)]

    @contextlib.contextmanager
    def replay(self, record):
        self.replayed.append(record)
        yield

    def begin(self, batch, plan, records):
        self.begun.append((batch, plan, records))
        self.records = records

    @contextlib.contextmanager
    def scope(self, k, chunk):
        self.events.append(("enter", k))
        if self.records is not None:
            rows = chunk.sample_ids.tolist()  # synthetic_batch: sample id = row
            self.read.append(self.records.layout(rows, chunk.input_ids.shape[1]))
        try:
            yield self
        finally:
            self.events.append(("exit", k))

    def loss_with_aux(self, loss, denom):
        self.events.append("aux")
        return loss


def rl_config(n_micro: int = 2) -> GRPOConfig:
    """Two optimizer steps of ``n_micro`` chunks each over 8 rows (the objective has no ratio)."""
    return GRPOConfig(batch_per_replica=8, group_size=2, mini_batch_per_replica=4,
                      micro_batch_per_replica=4 // n_micro)


class NoRatio:
    """An objective without a ratio: no pi_old to freeze, so only a hook can ask for the ahead pass."""

    def needs_old_logprobs(self) -> bool:
        return False


NO_RATIO = NoRatio()


def bare(needs: HookNeeds):
    torch.manual_seed(0)
    model = Toy().double()
    events = []
    hook = EmbedNorm(model, events, needs)
    ahead = AheadPass(model, lambda c: score(model, c), hooks=[hook])
    updater = Updater(model, forward_chunk(model, events), Split(rows=8, n_mini=2, n_micro=2),
                      batch_needs(rl_config(), NO_RATIO, [hook]), ahead, hooks=[hook])
    updater.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    model.head.weight.register_hook(lambda g: events.append("backward") or g)
    return updater, hook, events


def test_a_hook_is_recorded_told_its_records_and_scoped_around_every_training_chunk():
    updater, hook, events = bare(HookNeeds(ahead_pass=True, every_chunk=True))
    assert updater.needs == Needs(records=True, every_chunk=True)  # the ahead pass runs for the hook alone
    batch = synthetic_batch(LENS, vocab=VOCAB, seed=3)
    initial = updater.policy.embed.weight.detach().clone()
    result = updater.update(batch)
    assert len(result.steps) == 2 and not any(s.skipped for s in result.steps)
    record = updater.ahead.records["embed_norm"]
    assert sorted(record.by_row) == list(range(8))  # every chunk recorded: mini-batch 0 too
    assert len(hook.begun) == 1 and hook.begun[0][1] is updater.last_plan and hook.begun[0][2] is record
    # Each training chunk's scope spans its forward, the hook's loss term and its backward, in walk order.
    per_chunk = [("enter", 0), "forward", "aux", "backward", ("exit", 0)]
    want = [e if isinstance(e, str) else (e[0], k) for k in range(4) for e in per_chunk]
    assert events == want  # the ahead pass and the probe score without the objective: no event of theirs
    # The probe replayed what the hook captured on the first ahead chunk (rows 0, 1, padding included), once.
    first = updater.last_plan.chunk(batch, 0, 0)
    assert len(hook.replayed) == 1
    torch.testing.assert_close(hook.replayed[0], initial[first.input_ids].norm(dim=-1), rtol=0, atol=1e-12)
    # What each training chunk read back is its rows' embedding norms at the ahead pass's (initial) weights.
    for k, (mini, micro) in enumerate(updater.last_plan.walk()):
        chunk = updater.last_plan.chunk(batch, mini, micro)
        want = initial[chunk.input_ids].norm(dim=-1) * chunk.attention_mask  # [B, W], 0 past each row
        torch.testing.assert_close(hook.read[k], want, rtol=0, atol=1e-12)


def test_a_hook_that_needs_nothing_gets_no_records_without_an_ahead_pass():
    updater, hook, events = bare(HookNeeds())
    assert updater.needs == Needs()
    updater.update(synthetic_batch(LENS, vocab=VOCAB, seed=3))
    assert hook.begun[0][2] is None and hook.replayed == [] and hook.read == []
    assert [e for e in events if isinstance(e, tuple)] == [(side, k) for k in range(4) for side in ("enter", "exit")]


class Declares:
    """Only the needs of a hook: what it declares, and what it was told."""

    def __init__(self, declared: HookNeeds) -> None:
        self.declared = declared
        self.told = []

    def needs(self, several_chunks: bool) -> HookNeeds:
        self.told.append(several_chunks)
        return self.declared


@pytest.mark.parametrize(("declared", "several", "want"), [
    (HookNeeds(every_chunk=True), True, Needs(every_chunk=True)),
    (HookNeeds(ahead_pass=True), False, Needs(records=True)),
])
def test_batch_needs_folds_in_what_each_hook_declares(declared, several, want):
    hook = Declares(declared)
    rl = rl_config(2 if several else 1)
    assert batch_needs(rl, NO_RATIO, [hook]) == want
    assert hook.told == [several]  # told whether a window may take several chunks
    assert batch_needs(rl, NO_RATIO, [hook], recorders=True) == Needs(records=True, every_chunk=True)


@pytest.mark.parametrize("hook", [RoutingReplay, EmbedNorm], ids=["RoutingReplay", "toy"])
def test_every_hook_has_the_protocols_members_with_its_parameter_names(hook):
    for member in ("needs", "capture", "split", "replay", "begin", "scope"):
        want = list(inspect.signature(getattr(ChunkHook, member)).parameters)
        assert list(inspect.signature(getattr(hook, member)).parameters) == want, member
    assert isinstance(hook.name, str) and isinstance(hook.token_dim, int)
