"""The parts ``GRPOModule.configure_model`` builds around a loaded policy, in the order each needs the last.

1. ``trainable``: the policy in train mode; under ``policy.lora`` the peft model (only the adapter trains) and
   the fingerprint of its base (checkpoints hold the adapter, and this to check the base).
2. ``scoring_parts``, once the image side is known (it may freeze a tower): the frozen reference, the objective's
   own models (OPD's teacher), MoE routing replay, and the chunk scorer that scores with all of them.
3. ``build_updater``: the update of one collected batch, scored by the module's ``forward_chunk``.

Nothing here sees the module: each builder takes the parts it reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from lightning_grpo import lora
from lightning_grpo.config import GRPOConfig
from lightning_grpo.objectives import Objective
from lightning_grpo.routing import RoutingReplay, attach_routing
from lightning_grpo.scoring import ChunkScorer, build_scorer, frozen_copy
from lightning_grpo.timing import StepTimer
from lightning_grpo.update import AheadPass, Recorder, Split, Updater, batch_needs
from lightning_grpo.update.loop import ForwardChunk
from lightning_grpo.vision import VisionProcessor


@dataclass(frozen=True)
class Trainable:
    """The policy as it trains."""

    policy: nn.Module
    """In train mode (``from_pretrained`` returns eval(); Lightning trains, and checks, in train mode)."""
    lora_base: lora.BaseFingerprint | None
    """Under ``policy.lora``, the fingerprint of the frozen base (None: no adapter)."""

    @property
    def has_adapter(self) -> bool:
        """Under ``policy.lora``: only the adapter trains, and the reference is the base (no copy)."""
        return self.lora_base is not None


def trainable(
    model: nn.Module, lora_cfg: lora.LoraConfig | None, seed: int
) -> Trainable:
    """``model`` ready to train: under ``lora_cfg`` peft freezes the base, and only the adapter trains."""
    if lora_cfg is None:
        return Trainable(model.train(), None)
    model = lora.apply_lora(model, lora_cfg, seed=seed)
    base = lora.fingerprint(model)
    return Trainable(model.train(), base)


@dataclass(frozen=True)
class ScoringParts:
    """What scores a chunk besides the policy."""

    ref: nn.Module | None
    """k3 KL's frozen copy (None: beta == 0, or LoRA: the base with the adapter off)."""
    routing: RoutingReplay | None
    """MoE routing replay (None: a dense policy, or off)."""
    scorer: ChunkScorer
    """Per-chunk logprobs of the policy and of the reference."""


def scoring_parts(
    policy: nn.Module,
    tokenizer,
    vision: VisionProcessor | None,
    objective: Objective,
    rl: GRPOConfig,
    temperature: float,
    has_adapter: bool,
    dp_mean: Callable[[Tensor], Tensor],
) -> ScoringParts:
    """The reference, the objective's models, routing replay and the scorer of a trainable ``policy``.

    Args:
        policy: the trained model (``trainable``), its image side already frozen or not.
        tokenizer: the policy's tokenizer (OPD refuses a teacher with another vocabulary).
        vision: the image side (None: text-only).
        objective: the loss (whether it needs a reference; OPD loads its teacher here).
        rl: routing replay, packing, the logits kept per slice.
        temperature: the sampling temperature (``rollout.temperature``).
        has_adapter: ``policy.lora`` is set (the reference is then the base: no copy).
        dp_mean: the mean over data-parallel ranks (routing replay's aux loss).
    """
    copy_ref = objective.needs_reference() and not has_adapter
    ref = frozen_copy(policy, copy_ref)
    objective.setup(policy, tokenizer)
    # before FSDP2 shards the routers, and before an engine starts (refusals)
    routing = attach_routing(policy, rl, dp_mean)
    routed = routing is not None
    scorer = build_scorer(policy, ref, vision, objective, rl, temperature, routed)
    return ScoringParts(ref, routing, scorer)


def build_updater(
    policy: nn.Module,
    forward_chunk: ForwardChunk,
    scorer: ChunkScorer,
    routing: RoutingReplay | None,
    objective: Objective,
    rl: GRPOConfig,
    *,
    recorders: list[Recorder],
    dp_sum: Callable[[Tensor], Tensor],
    seed: int,
    timer: StepTimer,
) -> Updater:
    """The update of one collected batch: split by ``rl``, ``forward_chunk`` on each chunk, the ahead pass (frozen
    pi_old from ``scorer``, the one-shot probe, MoE routes, ``recorders``) when ``plan.batch_needs`` asks for it.

    Built for one process, wherever it is built (``configure_model`` may run before ``Trainer.fit``): the ranks'
    split and reductions replace it when the optimizer joins (``Updater.attach``), once the strategy is known.
    """
    split = Split.of(rl, 1, scorer.packed)
    # per-chunk hooks (update/records.py)
    hooks = [routing] if routing is not None else []
    ahead = AheadPass(
        policy, scorer.pi_old, dp_sum=dp_sum, hooks=hooks, recorders=recorders
    )
    needs = batch_needs(rl, objective, hooks, bool(recorders))
    return Updater(
        policy,
        forward_chunk,
        split=split,
        needs=needs,
        ahead=ahead,
        hooks=hooks,
        seed=seed,
        max_grad_norm=rl.max_grad_norm,
        max_consecutive_skips=rl.max_consecutive_skips,
        timer=timer,
    )
