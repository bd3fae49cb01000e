"""MoE routing replay: ``hooks`` (record / force each router's top-k) and ``replay`` (one collected batch)."""

from lightning_grpo.routing.hooks import (
    SUPPORTED_BLOCKS,
    SUPPORTED_ROUTERS,
    ReplayHooks,
    RoutingRecord,
    RoutingReplayError,
    assignment_counts,
    find_routers,
    moe_blocks,
    record_counts,
    renormalizes,
    replayed_scores,
    verify_router,
)
from lightning_grpo.routing.replay import (
    AuxLossSpec,
    RoutingReplay,
    attach_routing,
    aux_loss_spec,
    rollout_refusal,
)

__all__ = [
    "SUPPORTED_BLOCKS",
    "SUPPORTED_ROUTERS",
    "AuxLossSpec",
    "ReplayHooks",
    "RoutingRecord",
    "RoutingReplay",
    "RoutingReplayError",
    "assignment_counts",
    "attach_routing",
    "aux_loss_spec",
    "find_routers",
    "moe_blocks",
    "record_counts",
    "renormalizes",
    "replayed_scores",
    "rollout_refusal",
    "verify_router",
]
