"""``GRPOModule``'s side of async rollouts (``rollout.max_off_policy_steps``; the engine side is
``rollout/prefetch.py``).

* ``wrap``: the engine, wrapped when k > 0, after the refusals (an engine in this process, no correction of the
  behaviour gap).
* ``training_draw``: loop step ``s``'s batch (in flight, or drawn now), then steps ``s+1 .. s+k`` put in flight
  from the data stream's next prompts with their own seeds; adds the staleness metrics.
* ``record`` / ``check_reissued``: a checkpoint records the prompts in flight; the resumed run draws them again
  (same prompts, same seeds: the data position did not pass them), so no prompt is lost or trained twice.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from lightning_grpo.checkpoint.signals import stop_poll
from lightning_grpo.rollout.base import Prompt, Rollout, RolloutEngine, SamplingConfig
from lightning_grpo.rollout.prefetch import AsyncRollouts, staleness_metrics
from lightning_grpo.vision import step_prompts

log = logging.getLogger(__name__)

KEY = "async_rollouts"
"""Checkpoint key: ``{"in_flight": {loop step: [prompt ids]}}``."""


def wrap(module, engine: RolloutEngine) -> RolloutEngine:
    """``engine`` as is (k = 0: the synchronous order), else ``AsyncRollouts`` over it."""
    k = module.rollout_cfg.max_off_policy_steps
    if not k:
        return engine
    return AsyncRollouts(engine, k, weights_step=lambda: module.loop_step)


def training_draw(module, engine: AsyncRollouts, prompts: Sequence[Prompt], job) -> tuple[list[Rollout], dict]:
    """This loop step's batch (``job(prompts, sampling)`` draws one with the wrapped engine), the next k in flight."""
    step = module.loop_step + 1
    should_stop = stop_poll(module.trainer, "rollouts in flight") if module._trainer is not None else None
    check_reissued(module, step, prompts)
    rollouts, metrics, weights_step = engine.take(step, prompts, module.sampling(), job, should_stop)
    engine.submit_ahead(step, lambda i: _next_batch(module, i), job)
    return rollouts, {**metrics, **staleness_metrics(step - 1 - weights_step, engine.k)}


def record(module, checkpoint: dict) -> None:
    """The prompts in flight go into the checkpoint (with the data position, which has not passed them)."""
    if isinstance(module.engine, AsyncRollouts):
        checkpoint[KEY] = {"in_flight": module.engine.in_flight()}


def restore(module, checkpoint: dict) -> None:
    # rank 0 writes the checkpoint, so it holds rank 0's prompts: the other ranks have their own and skip the check
    saved = checkpoint.get(KEY, {}).get("in_flight", {}) if module.global_rank == 0 else {}
    module._reissue = dict(saved)


def check_reissued(module, step: int, prompts: Sequence[Prompt]) -> None:
    """A resumed run draws the checkpoint's in-flight prompts again; say so, and warn when the data gives others."""
    saved = getattr(module, "_reissue", None) or {}
    if step not in saved:
        return
    ids = saved.pop(step)
    if ids == [p.id for p in prompts]:
        log.info("loop step %d: drawing again the %d prompts that were in flight at the checkpoint", step, len(ids))
    else:
        log.warning("loop step %d: the checkpoint had prompts %s in flight but the data now gives %s (the prompt "
                    "source changed since the checkpoint?)", step, ids[:8], [p.id for p in prompts][:8])


def _next_batch(module, ahead: int) -> tuple[list[Prompt], SamplingConfig] | None:
    """Loop step ``loop_step + 1 + ahead``'s prompts (without the bad records the draw would skip) and sampling."""
    dm = module._datamodule()
    if not (hasattr(dm, "records") and hasattr(dm, "position")):
        return None  # not a PromptDataModule: its next batch is unknown until Lightning fetches it
    records = dm.records(dm.position - 1 + ahead)
    try:
        prompts, skipped = step_prompts(records, module.tokenizer, module.vision, module._on_bad_record())
    except Exception:  # noqa: BLE001 - the step itself meets (and reports) a bad record when it comes
        return None
    return [p for i, p in enumerate(prompts) if i not in skipped], module.sampling(ahead=ahead)
