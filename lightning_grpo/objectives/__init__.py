"""Objectives behind one protocol (``base.Objective``), picked by name: ``model.objective: grpo | opd``.

Each entry names its config dataclass (the module section that holds its knobs, ``None`` when ``rl``
has them all) and a builder ``build(module) -> Objective``. Adding an objective::

    from lightning_grpo.objectives import register_objective

    register_objective("mine", lambda module: MyObjective(module.rl, dp_mean=module.dp_mean))
    GRPOModule(objective="mine")

(see docs/objectives.md). DPO trains on preference pairs, not rollouts, so it has its own module
(``lightning_grpo.dpo.DPOModule``) on the same accumulator, loop and roll-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_grpo.objectives.base import Objective, PolicyView, Stats


@dataclass(frozen=True)
class ObjectiveEntry:
    """One registered objective."""

    build: Callable[[Any], Objective]
    """``build(module)``: the objective for a ``GRPOModule`` (reads ``module.rl``, its own section, ``dp_mean``)."""
    section: str | None = None
    """The module argument that holds its config dataclass (``"opd"``); None = ``rl`` holds every knob."""


OBJECTIVES: dict[str, ObjectiveEntry] = {}
"""The registry: ``model.objective`` names one of these."""


def register_objective(name: str, build: Callable[[Any], Objective], section: str | None = None) -> None:
    """Make ``model.objective: <name>`` build ``build(module)``; a name registers once."""
    if name in OBJECTIVES and OBJECTIVES[name].build is not build:
        raise ValueError(f"objective {name!r} is already registered; pick another name")
    OBJECTIVES[name] = ObjectiveEntry(build, section)


def build_objective(name: str, module) -> Objective:
    """The objective called ``name`` for ``module``; the error lists the registered names."""
    if name not in OBJECTIVES:
        raise ValueError(f"objective={name!r}: not a registered objective; known: {', '.join(sorted(OBJECTIVES))} "
                         "(lightning_grpo.objectives.register_objective adds one)")
    objective = OBJECTIVES[name].build(module)
    if not isinstance(objective, Objective):
        raise TypeError(f"objective {name!r} built a {type(objective).__name__}, which lacks the Objective protocol "
                        "(needs_old_logprobs, needs_reference, setup, chunk_loss, name)")
    return objective


# The builders import their objective when called: this ``__init__`` runs before every ``objectives.base`` import,
# and importing opd here would hand each of those the teacher and policy stack (no circle either way).
def _grpo(module) -> Objective:
    from lightning_grpo.objectives.grpo import GRPOObjective

    rl = module.rl
    return GRPOObjective(rl.epsilon, rl.epsilon_high, rl.beta, dp_mean=module.dp_mean, loss_type=rl.loss_type,
                         ratio_level=rl.ratio_level, loss=rl.loss,
                         max_completion_length=module.rollout_cfg.max_new_tokens,  # Dr. GRPO's constant
                         correction=rl.rollout_correction, entropy_coef=rl.entropy_coef,
                         top_entropy_quantile=rl.top_entropy_quantile)


def _opd(module) -> Objective:
    from lightning_grpo.objectives.opd import OPDObjective

    return OPDObjective(module.opd_cfg, module.rl, dp_mean=module.dp_mean)


register_objective("grpo", _grpo)
register_objective("opd", _opd, section="opd")

__all__ = ["OBJECTIVES", "Objective", "ObjectiveEntry", "PolicyView", "Stats", "build_objective",
           "register_objective"]
