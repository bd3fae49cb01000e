"""Trainer offload backends: the host-copy fallback round trip bit for bit, the backend choice, the
torch_memory_saver adoption logic (against a stand-in; the real package is exercised by tests/gpu/)."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
from torch import nn

from lightning_grpo import offload
from lightning_grpo.offload import (
    HostOffload,
    NoOffload,
    TorchMemorySaverOffload,
    memory_saver_usable,
    pinning_available,
    select_offload,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class Tied(nn.Module):
    """Embedding tied to the head (as the tiny policy), a norm and a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)) * self.scale)


def trained(device: str, steps: int = 2, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and AdamW after ``steps`` steps, with the last gradients still attached."""
    torch.manual_seed(seed)
    model = Tied().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(steps):
        step(model, opt, seed=i, keep_grads=i == steps - 1)
    return model, opt


def step(model, opt, seed: int, keep_grads: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (4, 7), generator=g).to(next(model.parameters()).device)
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    opt.step()
    if not keep_grads:
        opt.zero_grad(set_to_none=True)


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {f"p.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    out |= {f"g.{k}": p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    for i, state in enumerate(opt.state.values()):
        out |= {f"s{i}.{k}": v.clone() for k, v in state.items()}
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_host_offload_round_trip_is_bit_exact_and_training_continues_identically(device):
    model, opt = trained(device)
    before, params = snapshot(model, opt), list(model.parameters())
    # Hold the originals so the allocator cannot hand their addresses to the copies (data_ptr comparison below).
    originals = [v for s in opt.state.values() for v in s.values()] + [p.data for p in params]
    old_ptrs = {t.data_ptr() for t in originals}
    off = HostOffload([model], [opt], device=device)

    moved = off.offload()
    assert not off.resident and off.offload() == 0  # idempotent
    for p in model.parameters():
        assert p.device.type == "cpu" and p.grad.device.type == "cpu" and p.is_pinned() == off.pin_memory
    host = [v for s in opt.state.values() for v in s.values()] + [p for p in model.parameters()]
    assert all(t.data_ptr() not in old_ptrs for t in host if t.numel() > 1)  # real copies, even on CPU
    unique = {id(p): p for p in params}.values()
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    grads_params = sum(2 * p.numel() * p.element_size() for p in unique)
    assert moved == state_bytes + grads_params + model.scale.element_size()  # the tied weight moved once

    off.onload()
    assert off.resident and list(model.parameters()) == params  # same Parameter objects: the optimizer still holds them
    assert model.head.weight is model.embed.weight
    after = snapshot(model, opt)
    assert after.keys() == before.keys()
    for k in before:
        assert after[k].device == before[k].device and torch.equal(after[k], before[k]), k

    # Two more optimizer steps after the round trip land exactly where they land without one.
    reference, ref_opt = trained(device)
    for i in (5, 6):
        step(model, opt, seed=i)
        step(reference, ref_opt, seed=i)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name


def test_pinning_follows_the_build():
    assert pinning_available() == torch.cuda.is_available()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cannot pin"):
            HostOffload([], [], device="cpu", pin_memory=True)


def test_memory_saver_is_not_usable_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("covered by tests/gpu/check_handoff.py on a GPU")
    usable, why = memory_saver_usable()
    assert not usable and "CUDA" in why


@pytest.mark.parametrize(
    ("backend", "device", "tms_ok", "kind"),
    [("auto", "cpu", False, "none"), ("auto", "cuda", False, "host"), ("auto", "cuda", True, "torch_memory_saver"),
     ("host", "cpu", False, "host")],
)
def test_backend_choice(backend, device, tms_ok, kind, fake_tms):
    chosen = select_offload(backend, [nn.Linear(2, 2)], [], torch.device(device), tms_ok)
    assert chosen.kind == kind and chosen.resident


def test_asking_for_an_unusable_memory_saver_names_the_knob_and_why():
    with pytest.raises(ValueError, match=r"offload_backend='torch_memory_saver'.*no CUDA"):
        select_offload("torch_memory_saver", [], [], torch.device("cpu"), False, "no CUDA device")
    assert NoOffload().offload() == 0


class FakeSaver:
    """Stands in for ``torch_memory_saver.torch_memory_saver``: records calls, tracks which region is open."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False):
        self.calls.append(f"region({tag}, backup={enable_cpu_backup})")
        yield

    def pause(self, tag=None):
        self.calls.append(f"pause({tag})")

    def resume(self, tag=None):
        self.calls.append(f"resume({tag})")


@pytest.fixture
def fake_tms(monkeypatch):
    saver = FakeSaver()
    monkeypatch.setitem(sys.modules, "torch_memory_saver", types.SimpleNamespace(torch_memory_saver=saver))
    return saver


def test_memory_saver_adopts_the_trainer_once_its_optimizer_has_state_then_pauses(fake_tms):
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    off = TorchMemorySaverOffload([model], [opt], device="cpu")
    tag = offload.TMS_TAG
    off.offload()
    off.onload()  # no optimizer state yet: a plain host round trip, nothing adopted
    assert fake_tms.calls == []
    step(model, opt, seed=0, keep_grads=True)
    off.offload()
    off.onload()  # state exists now: re-allocated inside the region with host backup
    assert fake_tms.calls == [f"region({tag}, backup=True)"]
    before = snapshot(model, opt)
    off.offload()
    assert all(p.grad is None for p in model.parameters())  # stale gradients are dropped, not paused
    off.onload()
    assert fake_tms.calls[1:] == [f"pause({tag})", f"resume({tag})"]
    after = snapshot(model, opt)
    assert all(torch.equal(after[k], before[k]) for k in after)
