"""Engine capabilities (``rollout/base.py``): typed, checked with ``isinstance``, and delegated explicitly by
``AsyncRollouts`` (no attribute forwarding), so the hand-off and the weight sync see through the wrapper."""

from __future__ import annotations

import pytest
import torch

from lightning_grpo.collect.async_rollouts import AsyncRollouts, unwrapped
from lightning_grpo.publisher import needs_publisher
from lightning_grpo.rollout.adapter_sync import serves_adapters
from lightning_grpo.rollout.base import (
    Closable,
    DeclaresWeights,
    DrawsAhead,
    HoldsWeights,
    LoadsAdapters,
    RolloutEngine,
    Served,
    WeightDevice,
    WeightDtype,
)
from lightning_grpo.rollout.weight_sync import push_weights

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier


class BareEngine:
    """The protocol and nothing else."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def generate(self, prompts, group_size, sampling):
        return []

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags=None) -> None: ...

    def load_weights(self, named_tensors) -> None:
        self.loaded.extend(named_tensors)

    def reset_prefix_cache(self) -> None: ...


class ServerLike(BareEngine):
    """Every capability a ``vllm serve`` client has."""

    holds_weights = True
    dtype = torch.bfloat16
    device = torch.device("cpu")
    server = None  # at a URL

    def __init__(self) -> None:
        super().__init__()
        self.adapters: list[str] = []
        self.closed = False

    def weight_names(self) -> list[str]:
        return ["w"]

    @property
    def serves_adapters(self) -> bool:
        return True

    def load_adapter(self, tensors, config_json) -> None:
        self.adapters.append(config_json)

    def close(self) -> None:
        self.closed = True


def wrapped(engine: RolloutEngine) -> AsyncRollouts:
    return AsyncRollouts(engine, 1, weights_step=lambda: 0)


def test_a_bare_engine_has_no_capability_and_is_published_to():
    engine = BareEngine()
    assert isinstance(engine, RolloutEngine)
    for capability in (Closable, HoldsWeights, WeightDtype, WeightDevice, DeclaresWeights, LoadsAdapters, Served):
        assert not isinstance(engine, capability), capability
    assert needs_publisher(engine, torch.nn.Linear(1, 1)) and not serves_adapters(engine)


def test_async_rollouts_delegates_the_capabilities_of_the_engine_it_wraps():
    inner = ServerLike()
    engine = wrapped(inner)
    try:
        assert isinstance(inner, Served) and not isinstance(engine, Served)  # unwrapped(engine) says where it samples
        assert unwrapped(engine) is inner and unwrapped(inner) is inner
        assert isinstance(engine, DrawsAhead) and engine.max_off_policy_steps == 1
        assert (engine.dtype, engine.device, engine.weight_names()) == (torch.bfloat16, torch.device("cpu"), ["w"])
        assert serves_adapters(engine) and needs_publisher(engine, torch.nn.Linear(1, 1))
        engine.load_adapter({}, "{}")
        assert inner.adapters == ["{}"]
        push_weights([("w", torch.ones(2))], engine)  # cast to the wrapped engine's dtype, as before
        assert [t.dtype for _, t in inner.loaded] == [torch.bfloat16]
    finally:
        engine.close()
    assert inner.closed


def test_async_rollouts_over_a_bare_engine_offers_nothing_it_cannot_do():
    inner = BareEngine()
    engine = wrapped(inner)
    try:
        assert (engine.dtype, engine.device, engine.weight_names()) == (None, None, [])
        assert not serves_adapters(engine)
        push_weights([("w", torch.ones(2, dtype=torch.float64))], engine)
        assert [t.dtype for _, t in inner.loaded] == [torch.float64]
    finally:
        engine.close()  # the wrapped engine has no close: only the worker stops
