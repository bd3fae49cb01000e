"""The publication after a level-2 sleep: the engine discarded its weights, so the sync rewrites every one.

The sync records the names it pushed and checks them against what the engine holds (its
``weight_names()``, else the policy's own tensors): a partial sync raises instead of letting the
engine sample with discarded weights.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator

from torch import Tensor, nn

from lightning_grpo import lora
from lightning_grpo.rollout import adapter_sync
from lightning_grpo.rollout.base import DeclaresWeights, RolloutEngine
from lightning_grpo.rollout.weight_sync import SyncStats, named_weights


def publish_checked(
    policy: nn.Module, engine: RolloutEngine, bucket_bytes: int, discarded: bool
) -> SyncStats:
    """Push every parameter and persistent buffer of ``policy`` to ``engine``; when the engine ``discarded`` its
    weights (a level-2 sleep), the base weights too, and check that every tensor it holds was rewritten."""
    pushed: list[str] = []
    # LoRA: the adapter alone (an engine with LoRA), else merged weights
    record = functools.partial(_recorded, names=pushed)
    stats = adapter_sync.publish_policy(
        policy,
        engine,
        bucket_bytes,
        with_base=discarded,
        record=record,
    )
    if discarded:
        check_complete(engine, policy, pushed)
    return stats


def check_complete(engine: RolloutEngine, policy: nn.Module, pushed: list[str]) -> None:
    """After a level-2 sleep every tensor the engine holds was discarded: the sync must have rewritten each."""
    names = engine.weight_names() if isinstance(engine, DeclaresWeights) else None
    if names:
        expected = set(names)
    else:
        # An engine that cannot say what it holds is checked against the policy's own tensors.
        own = (
            adapter_sync.engine_weights(policy, merged=False)
            if lora.is_lora(policy)
            else named_weights(policy)
        )
        expected = {name for name, _ in own}
    missing = sorted(expected - set(pushed))
    if missing:
        raise RuntimeError(
            f"weight sync after a level-2 sleep rewrote {len(expected) - len(missing)} of the {len(expected)} "
            f"tensors the engine holds (missing e.g. {missing[:5]}): the engine discarded its weights, so the "
            "policy must provide every one of them under the engine's names (or use sleep_level=1)"
        )


def _recorded(
    named: Iterable[tuple[str, Tensor]], names: list[str]
) -> Iterator[tuple[str, Tensor]]:
    for name, tensor in named:
        names.append(name)
        yield name, tensor
