"""``model.optim`` is the one optimizer source: ``--optimizer`` / ``--lr_scheduler`` are refused with the fix.

LightningCLI offers both keys; the CLI accepts them in every form a user may try (a class, its init args, a
config file's section), so that the refusal can say what to set instead.
"""

from __future__ import annotations

import re

from lightning.pytorch.cli import LRSchedulerTypeTuple
from torch.optim import Optimizer

OPTIMIZER_REFUSED = (
    "Not accepted: the optimizer is AdamW from model.optim (--model.optim.lr, .weight_decay, .betas, .eps) and "
    "its schedule is model.optim.warmup_steps/schedule/total_steps, stepped once per optimizer step by the loop. "
    "For another optimizer subclass GRPOModule and override configure_optimizers (--model.class_path)."
)


def add_refused_optimizer_args(parser) -> None:
    """``--optimizer`` and ``--lr_scheduler`` as keys of ``parser`` (never built), their help the refusal."""
    common = {"required": False, "instantiate": False, "fail_untyped": False}
    parser.add_subclass_arguments(
        Optimizer,
        "optimizer",
        skip={"params"},
        help=OPTIMIZER_REFUSED,
        **common,
    )
    parser.add_subclass_arguments(
        LRSchedulerTypeTuple,
        "lr_scheduler",
        skip={"optimizer"},
        help=OPTIMIZER_REFUSED,
        **common,
    )


def names_optimizer(err: BaseException) -> bool:
    """Whether a jsonargparse parse error is about the ``optimizer`` or ``lr_scheduler`` key."""
    return re.search(r'key "(optimizer|lr_scheduler)"', str(err)) is not None
