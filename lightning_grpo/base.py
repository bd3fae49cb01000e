"""What every lightning-grpo module shares: an ``Updater``, AdamW and its schedule, the precision step, the DP ops,
and the lifecycle that makes any Lightning checkpoint resume exactly.

A subclass (``GRPOModule``, ``DPOModule``) builds its policy and its ``Updater`` in ``configure_model`` and turns a
``training_step`` batch into an update; everything around the update is here, written once:

* ``setup``: the subclass's rules that need the strategy (``check_strategy``), loop-step progress bars and the LR
  schedule's horizon (``steps_per_loop_step`` optimizer steps per batch).
* ``on_fit_start``: the precision check, once the weights are final.
* ``configure_optimizers``: AdamW over the trainable parameters, with the schedule stepped per optimizer step.
* ``on_train_start``: the updater gets the optimizer, stepped through the precision plugin (unscale -> 1/sum ->
  clip -> step), and a loaded checkpoint's state is put back into it.
* ``on_save_checkpoint`` / ``on_load_checkpoint``: the state at the last batch boundary (``checkpoint/state.py``);
  parameters holding NaN/inf are never written.
* ``end_loop_step``: the batch boundary (what any checkpoint records until the next loop step ends).
* ``publish``: the row each loop step logs: the subclass's metrics, the counters and the step timer's columns, one
  figure per metric for the whole job (``metrics.loop_step_row``).
"""

from __future__ import annotations

import copy
import logging
import math
from typing import TYPE_CHECKING

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_grpo.checkpoint import adapter
from lightning_grpo.checkpoint.identity import (
    IDENTITY_KEY,
    apply_optim,
    identity,
    optim_changes,
)
from lightning_grpo.checkpoint.state import (
    STATE_KEY,
    LoopState,
    NonFiniteParametersError,
    nonfinite_parameter,
)
from lightning_grpo.config import OptimConfig
from lightning_grpo.determinism import run_seed
from lightning_grpo.distributed import DataParallelOps, data_parallel_mesh, shard_fsdp2
from lightning_grpo.metrics import loop_step_row
from lightning_grpo.policy import PolicyConfig, load_policy, with_seed
from lightning_grpo.precision import PluginStep, adamw_kernel, check_precision
from lightning_grpo.progress import count_loop_steps
from lightning_grpo.schedule import build_scheduler, check_horizon, run_length
from lightning_grpo.timing import StepTimer
from lightning_grpo.update import DataParallel, Split, Updater
from lightning_grpo.upstream import quiet_upstream_warnings
from lightning_grpo.validation import ValidationMeans, is_measurement

if TYPE_CHECKING:  # annotations only
    from lightning_grpo.lora import BaseFingerprint

log = logging.getLogger(__name__)


class UpdateModule(DataParallelOps, LightningModule):
    """A manual-optimization LightningModule whose ``training_step`` is one ``Updater.update``.

    Args:
        policy: which model to train.
        optim: AdamW and its schedule, stepped once per optimizer step.
        seed: the module's seed; None = the seed ``seed_everything`` applied, else 0.
    """

    def __init__(
        self, policy: PolicyConfig, optim: OptimConfig, seed: int | None
    ) -> None:
        super().__init__()
        self.automatic_optimization = False  # the updater steps the optimizer itself
        # one source of truth: model.seed, else seed_everything's
        resolved = run_seed(seed)
        self.seed = resolved.value
        self.seed_source = resolved.source
        # the tiny build it used
        self.policy_cfg = with_seed(copy.deepcopy(policy or PolicyConfig()), self.seed)
        self.optim_cfg = copy.deepcopy(optim or OptimConfig())
        # built by configure_model, with the tokenizer and the reference
        self.policy: nn.Module | None = None
        self.tokenizer = None
        self.ref: nn.Module | None = None
        # under policy.lora: the frozen base its checkpoints leave out
        self.lora_base: BaseFingerprint | None = None
        # built by configure_model; the optimizer joins it in on_train_start
        self.updater: Updater | None = None
        # epoch means of val/* (torchmetrics: synced across ranks)
        self.val_means = ValidationMeans()
        self.last_metrics: dict[str, float] = {}
        # optimizer hyper-parameters a resume changed (checkpoint/identity.py)
        self._optim_changes: dict = {}
        # what every checkpoint records (see on_save_checkpoint)
        self._state = LoopState()
        # resolved from the Trainer at setup
        self.schedule_horizon: int | None = self.optim_cfg.total_steps or None
        # the loop step's phases (timing.py): time/* columns in every row
        self.timer = StepTimer()

    @property
    def loop_step(self) -> int:
        """Collected batches consumed so far (the logged ``step``; checkpoint cadence counts these); a loaded
        checkpoint's until training resumes it (``validate --ckpt_path`` labels its row with that step)."""
        pending = self._state.pending_loop_step
        if pending is not None:
            return pending
        return self.updater.loop_step if self.updater is not None else 0

    @property
    def at_batch_boundary(self) -> bool:
        """Whether no optimizer step was taken since the last loop step ended (an emergency save is exact then)."""
        return self._state.at_boundary(self.global_step)

    @property
    def steps_per_loop_step(self) -> int:
        """Optimizer steps one batch takes when no window is skipped (1 here; GRPO: ``mu_iterations x n_mini``)."""
        return 1

    def resolve_horizon(self, steps_per_loop_step: int) -> None:
        """A decaying LR schedule needs a horizon: resolved from the Trainer (refused here, before the model is set
        up, when there is none)."""
        # Lightning would set up, train nothing and end without a word
        if self.trainer.max_steps == 0:
            raise ValueError(
                "trainer.max_steps=0: the fit would train nothing and end silently; set trainer.max_steps "
                "> 0 (optimizer steps = loop steps x mu_iterations x n_mini), or -1 with trainer.max_epochs"
            )
        run = run_length(self.trainer, steps_per_loop_step)
        self.schedule_horizon = self.optim_cfg.total_steps or run
        check_horizon(self.optim_cfg, self.schedule_horizon, run)

    def configure_policy(self):
        """(model, tokenizer), built by ``configure_model``. Default: ``load_policy(self.policy_cfg)``."""
        return load_policy(self.policy_cfg)

    def check_strategy(self) -> None:
        """Raise the rules that need the strategy (the DP size, its kind); ``setup`` calls it before any model is
        built. Nothing here; a subclass checks its sections."""

    def shard(self, *models: nn.Module | None) -> None:
        """FSDP2-shard ``models`` over the data-parallel ranks under ``ModelParallelStrategy`` (DDP wraps the whole
        module itself; one process needs nothing)."""
        if self._trainer is None or not isinstance(
            self.trainer.strategy, ModelParallelStrategy
        ):
            return
        mesh = data_parallel_mesh(self.trainer.strategy)
        for model in models:
            if model is not None:
                shard_fsdp2(model, mesh)

    def context_length(self) -> int | None:
        """The policy's context length (prompt + completion tokens), or None where its config does not say."""
        return getattr(
            getattr(self.policy, "config", None), "max_position_embeddings", None
        )

    # -- Lightning hooks ---------------------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        self.check_strategy()  # per-rank divisibility needs the DP size
        quiet_upstream_warnings()
        # Lightning's bars count batches (= loop steps) against optimizer steps
        if self._trainer is not None:
            count_loop_steps(self.trainer)
        if stage == "fit":
            self.resolve_horizon(self.steps_per_loop_step)

    def on_fit_start(self) -> None:
        # The weights are final here (precision plugin conversion, FSDP2 sharding): refuse or warn once per fit.
        check_precision(
            str(self.trainer.precision),
            self.policy,
            self.device.type == "cpu",
            self._scaler(),
        )

    def configure_optimizers(self):
        o = self.optim_cfg
        params = [p for p in self.policy.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(
            params,
            lr=o.lr,
            betas=o.betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
            **adamw_kernel(params, o.fused, self._scaler()),
        )
        return [opt], [build_scheduler(opt, o, self.schedule_horizon)]

    def on_train_start(self) -> None:
        opt = self.optimizers()
        # unscale -> 1/sum -> clip -> step via the plugin
        plugin_step = PluginStep(self.trainer, self.policy, opt)
        schedulers = self.lr_schedulers()
        # the strategy is set up: the ranks' split and reductions are known now
        split, dp = self.data_parallel()
        self.updater.attach(
            opt,
            schedulers,
            self.manual_backward,
            step=plugin_step,
            clip=plugin_step.clip,
            split=split,
            dp=dp,
        )
        listed = (
            []
            if schedulers is None
            else schedulers
            if isinstance(schedulers, list)
            else [schedulers]
        )
        # a resume under another lr
        if (changed := apply_optim(self._optim_changes, opt, listed)) is not None:
            rank_zero_warn(changed)
        self._optim_changes = {}
        self._state.resume(self.trainer, self.updater, self.trainer.datamodule)
        self.end_loop_step()
        self.timer.restart(self.device)  # the first loop step's time/step starts here

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        # the last hook before training_step: a loaded RNG state is restored here
        self._state.step_started()

    def on_before_optimizer_step(self, optimizer) -> None:
        loop = self.updater.loop if self.updater is not None else None
        step = loop.accumulator.step if loop is not None else None
        # in a GradScaler step the plugin has unscaled: now the divisor and the clip
        if isinstance(step, PluginStep):
            step.before_optimizer_step()

    def on_validation_end(self) -> None:
        # Lightning logs nothing in its sanity check; one over every held-out batch measured the starting weights
        # (num_sanity_val_steps: -1), so it gets its metrics row at this loop step like any validation.
        if self.trainer.sanity_checking and is_measurement(self.trainer):
            found = self.trainer.callback_metrics
            row = {
                name: float(found[name])
                for name in self.val_means.names()
                if name in found and name != "step"
            }
            for logger in self.trainer.loggers:
                logger.log_metrics(row, step=self.loop_step)
                logger.save()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Every checkpoint Lightning writes carries the state at the last batch boundary (checkpoint/state.py).

        Parameters holding NaN/inf are never written, whoever saves: a save is refused
        (``NonFiniteParametersError``). On the way out of a failure (``OnExceptionCheckpoint``) raising would
        replace that failure and skip Lightning's teardown, so the file is written without weights or optimizer
        state instead, saying why, and loading it refuses with that reason.
        """
        # a collective under DP: every rank refuses
        if (bad := nonfinite_parameter(self.trainer)) is not None:
            refused = NonFiniteParametersError(bad)
            if self.trainer.state.status != TrainerStatus.INTERRUPTED:
                raise refused
            log.error(
                "%s: the checkpoint written while handling the failure holds no weights",
                refused,
            )
            for key in ("state_dict", "optimizer_states", "lr_schedulers"):
                checkpoint.pop(key, None)
            checkpoint[STATE_KEY] = {"refused": str(refused)}
            return
        self._state.write(self.trainer, checkpoint)
        # a resume compares its config with it (checkpoint/identity.py)
        checkpoint[IDENTITY_KEY] = self._identity()
        # LoRA: the base is rebuilt
        adapter.save_adapter(checkpoint, self.policy, self.lora_base, "policy.")

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        refused = (checkpoint.get(STATE_KEY) or {}).get("refused")
        # written without weights on the way out of a failure: nothing to resume
        if refused:
            raise NonFiniteParametersError.loading(refused)
        # seed/model/dtype changed: refused now; optimizer hyper-parameters: applied at on_train_start, with a warning
        self._optim_changes = optim_changes(
            checkpoint.get(IDENTITY_KEY), self._identity()
        )
        # put back at on_train_start, once the updater has its loop
        self._state.load(checkpoint)
        # before Lightning loads it
        adapter.load_adapter(checkpoint, self.policy, self.lora_base, "policy.")

    def split(self) -> Split:
        """How this rank cuts a collected batch (here: the updater's own; GRPO derives it from ``rl`` per rank)."""
        return self.updater.split

    def data_parallel(self) -> tuple[Split, DataParallel]:
        """How this rank cuts a batch and the reductions one update needs, as the strategy set the ranks up. Read in
        ``on_train_start``, never earlier: a user may build the model (``configure_model``) before ``fit``."""
        dp = DataParallel(
            max=self.dp_group().max,
            grad_sync=self.dp_grad_sync,
            all_finite=self.dp_all_finite,
        )
        return self.split(), dp

    # -- the batch boundary and the report -----------------------------------------------------------------------------
    def end_loop_step(self) -> None:
        """The batch boundary: what any checkpoint records until the next loop step ends."""
        self._state.boundary(self.updater, self.global_step, self.trainer.datamodule)

    def counters(self) -> dict[str, float]:
        """The row's counters: ``loop_step`` (also ``step``, the loggers' x-axis: collected batches) and
        ``global_step`` (optimizer steps)."""
        loop_step = float(self.loop_step)
        return {
            "loop_step": loop_step,
            "global_step": float(self.global_step),
            "step": loop_step,
        }

    def log_validation(self, metrics: dict[str, float], weight: int) -> None:
        """One validation batch's ``val/*`` metrics, averaged over the epoch (weighted, synced across ranks)."""
        for name, mean, attribute in self.val_means.add(metrics, weight, self.device):
            self.log(
                name, mean, on_step=False, on_epoch=True, metric_attribute=attribute
            )

    def publish(
        self, metrics: dict[str, float], rows: int, bar: dict[str, str]
    ) -> None:
        """Log one row per loop step: ``metrics`` with the counters and the step timer's columns, one figure per
        metric for the whole job (``metrics.loop_step_row``; ``rows``: trajectories or pairs per rank), to the
        loggers; ``bar`` (label -> metric name) picks what the progress bar shows."""
        columns = self.timer.columns()
        row = loop_step_row(
            metrics, self.counters(), columns, self.dp_all_reduce, self.dp_size(), rows
        )
        shown = {label: row.get(name, math.nan) for label, name in bar.items()}
        self.log_dict(row, on_step=True, on_epoch=False, batch_size=1)
        self.log_dict(
            shown,
            prog_bar=True,
            logger=False,
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )
        self.last_metrics = row

    def _identity(self) -> dict:
        """What a checkpoint records about this run: seed, model, dtype, optimizer (``checkpoint/identity.py``)."""
        return identity(self.seed, self.policy, self.policy_cfg.dtype, self.optim_cfg)

    def _scaler(self):
        """The precision plugin's GradScaler (16-mixed), or None."""
        return (
            getattr(self.trainer.precision_plugin, "scaler", None)
            if self._trainer is not None
            else None
        )
