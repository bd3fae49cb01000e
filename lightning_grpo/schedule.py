"""The LR schedule: transformers' schedule functions over one resolved horizon.

We step the scheduler ourselves, once per optimizer step that lands (Lightning never steps it under
manual optimization), so the horizon is in optimizer steps. It is resolved once, in this order:

1. ``optim.total_steps`` when set;
2. ``trainer.max_steps`` (optimizer steps already), capped by what the epochs allow;
3. the epochs: Lightning's ``estimated_stepping_batches`` counts training batches = loop steps
   (``max_epochs`` x ``limit_train_batches``, the sweep's setup), times the optimizer steps per loop
   step (``mu_iterations x n_mini``, ``GRPOConfig.steps_per_loop_step``).

A decaying schedule without a horizon (an endless run) is refused, naming ``optim.total_steps``:
guessing one is how a cosine collapses to 0 after one step.
"""

from __future__ import annotations

import math

from torch.optim.lr_scheduler import LambdaLR

from lightning_grpo.checks import ConfigError
from lightning_grpo.config import OptimConfig

DECAYING = ("cosine", "linear")


def run_length(trainer, steps_per_loop_step: int) -> int | None:
    """Optimizer steps this fit will take (items 2-3 of the module docstring); None when it has no countable end.

    Args:
        trainer: the Lightning Trainer, or None (a module used without one).
        steps_per_loop_step: optimizer steps per collected batch (``mu_iterations x n_mini``).
    """
    if trainer is None:
        return None
    by_steps = trainer.max_steps if trainer.max_steps > 0 else math.inf
    # batches = loop steps, capped at max_steps; inf or -1: endless
    loop_steps = trainer.estimated_stepping_batches
    by_epochs = (
        loop_steps * steps_per_loop_step if 0 < loop_steps < math.inf else math.inf
    )
    horizon = min(by_steps, by_epochs)
    return None if math.isinf(horizon) else int(horizon)


def schedule_horizon(
    optim: OptimConfig, trainer, steps_per_loop_step: int
) -> int | None:
    """Optimizer steps the schedule spans: ``optim.total_steps``, else the run's length (None: no countable end)."""
    return optim.total_steps or run_length(trainer, steps_per_loop_step)


def check_horizon(
    optim: OptimConfig, horizon: int | None, run_steps: int | None = None
) -> None:
    """Refuse a decaying schedule with no horizon, or one it cannot cover (a ``ConfigError`` naming the fix)."""
    if optim.schedule not in DECAYING:
        return
    if horizon is None:
        raise ConfigError(
            f"optim.schedule={optim.schedule!r} decays over a horizon, but this run has no countable end "
            "(trainer.max_steps=-1 and an endless epoch): set optim.total_steps (optimizer steps), or "
            "trainer.max_steps, or trainer.max_epochs with trainer.limit_train_batches"
        )
    if run_steps is not None and optim.total_steps and run_steps > optim.total_steps:
        raise ConfigError(
            f"optim.total_steps={optim.total_steps} is shorter than the run ({run_steps} optimizer "
            f"steps): the {optim.schedule} schedule would end early (cosine even rises again); set "
            "optim.total_steps >= the run's optimizer steps, or 0 to use the run's length"
        )


def build_scheduler(optimizer, optim: OptimConfig, horizon: int | None) -> LambdaLR:
    """transformers' schedule for ``optim.schedule`` (warmup ramps linearly from 0, as in transformers)."""
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    if optim.schedule == "constant":
        return get_constant_schedule_with_warmup(optimizer, optim.warmup_steps)
    check_horizon(optim, horizon)
    build = (
        get_cosine_schedule_with_warmup
        if optim.schedule == "cosine"
        else get_linear_schedule_with_warmup
    )
    return build(
        optimizer, num_warmup_steps=optim.warmup_steps, num_training_steps=horizon
    )
