"""A resume under another config: refuse what breaks exactness, apply optimizer hyper-parameters with a warning.

Lightning restores the optimizer's and scheduler's state from the checkpoint, learning rate included, so
``--model.optim.lr=0.005`` on a resume was ignored while config.yaml recorded 0.005; and a resume with another seed,
dtype or model ran on silently, though nothing about it was the run it claimed to continue. Every checkpoint now
records what the run *is* (``IDENTITY_KEY``: seed, the model's architecture and size, its dtype, the optimizer's
hyper-parameters), and a resume compares:

- seed, model (``model_type`` and parameter count: not the path, a folder may move), ``policy.dtype`` differ: refused (``ResumeMismatchError``) before any state loads. The
  sampling streams derive from the seed; the weights belong to that model in that dtype. Start a new run instead.
- ``optim.lr``, ``weight_decay``, ``betas``, ``eps`` differ: applied once the optimizer state is restored, with a
  warning naming old and new and the LR the run then uses (the schedule's position is kept: lr = new x factor).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from lightning_grpo.config import OptimConfig

log = logging.getLogger(__name__)

IDENTITY_KEY = "grpo_run"
FIXED = ("seed", "model", "policy.dtype")
"""What a resume may not change."""
OPTIM = ("lr", "weight_decay", "betas", "eps")
"""Optimizer hyper-parameters a resume may change (applied with a warning)."""


class ResumeMismatchError(ValueError):
    """A resume's config differs from its checkpoint's in something that breaks the run's identity."""


def identity(
    seed: int, policy: nn.Module | None, dtype: str, optim: OptimConfig
) -> dict[str, Any]:
    """What a checkpoint records about the run (plain values: ``weights_only`` loads them).

    Args:
        seed: the run's seed (the sampling streams derive from it).
        policy: the trained model (None before it is built).
        dtype: ``policy.dtype``.
        optim: the optimizer's section.
    """
    return {
        "seed": seed,
        "model": _model(policy),
        "policy.dtype": dtype,
        "optim": {
            "lr": optim.lr,
            "weight_decay": optim.weight_decay,
            "betas": list(optim.betas),
            "eps": optim.eps,
        },
    }


def _model(policy) -> str | None:
    """``"<model_type>, <n> parameters"``: another architecture or size, not another copy of the same one (a LoRA
    resume onto other base weights is the adapter check's: ``checkpoint/adapter.py``)."""
    if policy is None:
        return None
    kind = getattr(getattr(policy, "config", None), "model_type", type(policy).__name__)
    return f"{kind}, {sum(p.numel() for p in policy.parameters()):,} parameters"


def optim_changes(
    saved: dict[str, Any] | None, now: dict[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """``{name: (old, new)}`` of the optimizer hyper-parameters changed since ``saved``.

    Raises:
        ResumeMismatchError: seed, model or dtype differ (all of them listed).
    """
    # a checkpoint from before identities were recorded: nothing to compare
    if not saved:
        return {}
    fixed = [
        f"{k}: {saved[k]!r} in the checkpoint, {now[k]!r} now"
        for k in FIXED
        if saved.get(k) is not None and now[k] is not None and saved[k] != now[k]
    ]
    if fixed:
        raise ResumeMismatchError(
            f"this resume changes what the run is ({'; '.join(fixed)}). A resume continues one run exactly: give "
            "the checkpoint's values back (drop --seed_everything / model.seed; model.policy.path, .dtype), or start a new run "
            "without --ckpt_path"
        )
    old = saved.get("optim", {})
    return {
        k: (old[k], now["optim"][k])
        for k in OPTIM
        if k in old and old[k] != now["optim"][k]
    }


def set_base_lr(lr: float, optimizer, schedulers) -> None:
    """A new base LR on every group; under ``LambdaLR`` schedulers, the LR at the schedule's current position from the
    new base, loaded through the scheduler's own state (so its ``get_last_lr()`` agrees)."""
    lrs = [lr] * len(optimizer.param_groups)
    for sched in schedulers:
        lrs = [lr * factor(sched.last_epoch) for factor in sched.lr_lambdas]
        state = sched.state_dict()
        state["base_lrs"] = [lr] * len(lrs)
        state["_last_lr"] = lrs
        sched.load_state_dict(state)
    for group, now in zip(optimizer.param_groups, lrs, strict=True):
        group["initial_lr"] = lr
        group["lr"] = now


def apply_optim(
    changes: dict[str, tuple[Any, Any]], optimizer, schedulers
) -> str | None:
    """Set the changed hyper-parameters on the restored ``optimizer`` (and the base LR of its ``LambdaLR``
    ``schedulers``); returns the warning to print, or None when nothing changed."""
    if not changes:
        return None
    for group in optimizer.param_groups:
        for name, (_, new) in changes.items():
            if name != "lr":
                group[name] = tuple(new) if name == "betas" else new
    if "lr" in changes:
        set_base_lr(changes["lr"][1], optimizer, schedulers)
    said = "; ".join(f"optim.{k} {old} -> {new}" for k, (old, new) in changes.items())
    return (
        f"resumed with other optimizer hyper-parameters than the checkpoint's: {said}; applied (the optimizer's "
        f"moments are kept). The learning rate is now {optimizer.param_groups[0]['lr']:.4g}."
    )
