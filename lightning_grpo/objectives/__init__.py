"""Objectives behind one protocol (``base.Objective``), picked by name: ``model.objective: grpo | opd``.

Each entry names its config dataclass (the module section that holds its knobs, ``None`` when ``rl``
has them all) and a builder ``build(parts: ObjectiveParts) -> Objective``: the builder gets the sections and the
DP mean it may read, never the module. Adding an objective::

    from lightning_grpo.objectives import ObjectiveParts, register_objective

    def build_mine(parts: ObjectiveParts) -> MyObjective:
        return MyObjective(parts.rl, dp_mean=parts.dp_mean)

    register_objective("mine", build_mine)
    GRPOModule(objective="mine")

(see docs/objectives.md). DPO trains on preference pairs, not rollouts, so it has its own module
(``lightning_grpo.dpo.DPOModule``) on the same accumulator, loop and roll-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torch import Tensor

from lightning_grpo.config import GRPOConfig
from lightning_grpo.objectives.base import Objective, PolicyView, Stats

# opd imports the teacher and policy stack: only its builder does, when called
if TYPE_CHECKING:
    from lightning_grpo.objectives.opd import OPDConfig


@dataclass(frozen=True)
class ObjectiveParts:
    """What a builder may read to make its objective (``GRPOModule.configure_objective`` fills it)."""

    rl: GRPOConfig
    """The ``rl`` section: clipping, KL, loss family, rollout correction, entropy knobs."""
    dp_mean: Callable[[Tensor], Tensor]
    """The data-parallel mean of a tensor (identity in one process): what the objective normalizes by."""
    max_new_tokens: int
    """``rollout.max_new_tokens``: the completion budget (Dr. GRPO's constant divisor)."""
    opd: OPDConfig | None = None
    """The ``opd`` section (teacher and distillation knobs); None when the module has none."""
    seed: int = 0
    """The module's seed: a ``tiny:`` teacher is built with it, like the policy."""


@dataclass(frozen=True)
class ObjectiveEntry:
    """One registered objective."""

    build: Callable[[ObjectiveParts], Objective]
    """``build(parts)``: the objective for a ``GRPOModule`` (reads ``parts.rl``, its own section, ``dp_mean``)."""
    section: str | None = None
    """The module argument that holds its config dataclass (``"opd"``); None = ``rl`` holds every knob."""


OBJECTIVES: dict[str, ObjectiveEntry] = {}
"""The registry: ``model.objective`` names one of these."""


def register_objective(
    name: str, build: Callable[[ObjectiveParts], Objective], section: str | None = None
) -> None:
    """Make ``model.objective: <name>`` build ``build(parts)``; a name registers once."""
    if name in OBJECTIVES and OBJECTIVES[name].build is not build:
        raise ValueError(f"objective {name!r} is already registered; pick another name")
    OBJECTIVES[name] = ObjectiveEntry(build, section)


def build_objective(name: str, parts: ObjectiveParts) -> Objective:
    """The objective called ``name``, built from ``parts``; the error lists the registered names."""
    if name not in OBJECTIVES:
        raise ValueError(
            f"objective={name!r}: not a registered objective; known: {', '.join(sorted(OBJECTIVES))} "
            "(lightning_grpo.objectives.register_objective adds one)"
        )
    objective = OBJECTIVES[name].build(parts)
    if not isinstance(objective, Objective):
        raise TypeError(
            f"objective {name!r} built a {type(objective).__name__}, which lacks the Objective protocol "
            "(needs_old_logprobs, needs_reference, setup, chunk_loss, name, stats)"
        )
    return objective


# The builders import their objective when called: this ``__init__`` runs before every ``objectives.base`` import,
# and importing opd here would hand each of those the teacher and policy stack (no circle either way).
def _grpo(parts: ObjectiveParts) -> Objective:
    from lightning_grpo.objectives.grpo import GRPOObjective

    rl = parts.rl
    return GRPOObjective(
        rl.epsilon,
        rl.epsilon_high,
        rl.beta,
        dp_mean=parts.dp_mean,
        loss_type=rl.loss_type,
        ratio_level=rl.ratio_level,
        loss=rl.loss,
        # Dr. GRPO's constant
        max_completion_length=parts.max_new_tokens,
        correction=rl.rollout_correction,
        entropy_coef=rl.entropy_coef,
        top_entropy_quantile=rl.top_entropy_quantile,
    )


def _opd(parts: ObjectiveParts) -> Objective:
    from lightning_grpo.objectives.opd import OPDConfig, OPDObjective
    from lightning_grpo.policy import with_seed

    opd = parts.opd or OPDConfig()  # refused by the objective: a teacher is required
    if opd.teacher is not None:  # a tiny: teacher is seeded like the policy
        opd = replace(opd, teacher=with_seed(opd.teacher, parts.seed))
    return OPDObjective(opd, parts.rl, dp_mean=parts.dp_mean)


register_objective("grpo", _grpo)
register_objective("opd", _opd, section="opd")

__all__ = [
    "OBJECTIVES",
    "Objective",
    "ObjectiveEntry",
    "ObjectiveParts",
    "PolicyView",
    "Stats",
    "build_objective",
    "register_objective",
]
