"""Upstream noise: warnings and log lines our runs printed that only their upstream can fix and that say
nothing about the run, each silenced at its source only (that message, from that module).
"""

from __future__ import annotations

import logging
import re
import warnings

UPSTREAM_WARNINGS = {
    # message start: (category, the module that warns, where it comes from)
    "`isinstance(treespec, LeafSpec)` is deprecated": (
        FutureWarning,
        "lightning.pytorch.utilities._pytree",
        (
            "Lightning's CombinedLoader builds torch's deprecated LeafSpec() at every fit and validate "
            "(Lightning-AI/pytorch-lightning#21326)"
        ),
    ),
    "`torch.distributed.reduce_op` is deprecated": (
        FutureWarning,
        "vllm.triton_utils.dispatcher",
        (
            "vLLM 0.32's Triton kernel scan reads every attribute of every loaded module, torch.distributed's "
            "deprecated alias included, when an engine starts"
        ),
    ),
    **{
        f"Precision {p} is not supported by the model summary": (
            UserWarning,
            "lightning.pytorch.utilities.model_summary.model_summary",
            (
                "Lightning's model summary at every fit under mixed precision (the GPU recipes): it then counts 32 bits a "
                "parameter, which is right, the master weights being float32"
            ),
        )
        for p in ("bf16-mixed", "16-mixed")
    },
}
"""Warnings our runs printed that only their upstream can fix and that say nothing about the run."""


def quiet_upstream_warnings() -> None:
    """Filter each of ``UPSTREAM_WARNINGS`` at its source: that message, from that module only.

    Called from the modules' ``setup`` (idempotent: ``filterwarnings`` replaces an equal filter), so it holds also
    where a caller reset the filters after import (pytest does, per test).
    """
    for start, (category, module, _) in UPSTREAM_WARNINGS.items():
        warnings.filterwarnings(
            "ignore",
            message=re.escape(start),
            category=category,
            module=re.escape(module) + "$",
        )


def quiet_litlogger_tip() -> None:
    """Drop Lightning's "Tip: ... try installing litlogger" line (an advert printed by every Trainer whose loggers
    are not LitLogger, lightning/pytorch/trainer/connectors/logger_connector.py): our runs log to CSV or W&B."""
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoLitLoggerTip) for f in rank_zero.filters):
        rank_zero.addFilter(_NoLitLoggerTip())


class _NoLitLoggerTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)
