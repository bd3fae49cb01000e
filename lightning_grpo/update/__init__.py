"""One update of a collected batch, with no Lightning import: plan -> records (ahead pass) -> loop -> accumulator.

``Updater.update(batch)`` is the whole of it; docs/update.md gives the call order.
"""

from lightning_grpo.update.accumulate import DeferredAccumulator, StepOutcome
from lightning_grpo.update.ahead import (
    AheadPass,
    ForwardNoisePolicy,
    eval_mode,
    train_mode,
)
from lightning_grpo.update.loop import CollectedBatchLoop, LoopProgress, LoopResult
from lightning_grpo.update.plan import (
    EMPTY,
    ChunkPlan,
    Needs,
    batch_needs,
    pi_old_source,
    plan_update,
)
from lightning_grpo.update.records import (
    ChunkHook,
    ChunkLoss,
    HookNeeds,
    Recorder,
    RowRecords,
)
from lightning_grpo.update.updater import DataParallel, Split, Updater

__all__ = [
    "EMPTY",
    "AheadPass",
    "ChunkHook",
    "ChunkLoss",
    "ChunkPlan",
    "CollectedBatchLoop",
    "DataParallel",
    "DeferredAccumulator",
    "ForwardNoisePolicy",
    "HookNeeds",
    "LoopProgress",
    "LoopResult",
    "Needs",
    "Recorder",
    "RowRecords",
    "Split",
    "StepOutcome",
    "Updater",
    "batch_needs",
    "eval_mode",
    "pi_old_source",
    "plan_update",
    "train_mode",
]
