"""``lightning-grpo``: the LightningCLI entry point (``fit``, ``validate``, ``--print_config``), ``plot`` and ``show``.

Every knob is a dotted key (``--model.rl.micro_batch_per_replica=8``), so YAML configs and
``wandb sweep`` drive the same surface. ``--model.class_path my_pkg.MyModule`` swaps in a
``GRPOModule`` subclass, or another module: ``lightning_grpo.DPOModule`` with ``--data.class_path
lightning_grpo.PreferenceDataModule`` runs DPO (configs/dpo-arith.yaml). A config error is reported in a few
lines (``LIGHTNING_GRPO_DEBUG=1`` shows the traceback), before any model is built where the error allows.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from pathlib import Path

import yaml
from jsonargparse import ArgumentParser, set_parsing_settings
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_grpo import run_folder
from lightning_grpo.alarm import SignalAlarm
from lightning_grpo.checkpoint import GRPOCheckpoint, resolve_ckpt_path
from lightning_grpo.checkpoint.resume import check_ckpt_file
from lightning_grpo.checks import retired_key
from lightning_grpo.cli_errors import LOAD_ERRORS, RUN_ERRORS, config_error
from lightning_grpo.cli_help import (
    SECTIONS,
    DataKeysParser,
    SectionHelp,
    default_help_class,
)
from lightning_grpo.cli_optimizer import (
    OPTIMIZER_REFUSED,
    add_refused_optimizer_args,
    names_optimizer,
)
from lightning_grpo.cli_verbs import add_verbs, run_verb
from lightning_grpo.collect.async_rollouts import unwrapped
from lightning_grpo.completions import CompletionLog
from lightning_grpo.data.prompts import PromptDataModule
from lightning_grpo.errors import logged_error
from lightning_grpo.handoff import HandoffCallback
from lightning_grpo.launcher import check_launch
from lightning_grpo.module import GRPOModule
from lightning_grpo.rollout.base import Served
from lightning_grpo.run_check import check_run
from lightning_grpo.run_folder import (
    RunFolderInUseError,
    claim_versions,
    explicit_version,
    refuse_reused_version,
)
from lightning_grpo.summary import RunSummary
from lightning_grpo.upstream import quiet_litlogger_tip

TRAINER_DEFAULTS = {
    # Under manual optimization Lightning counts logging in batches = loop steps: log every one.
    "log_every_n_steps": 1,
    "logger": {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": "runs"},
    },
    "max_steps": 20,
    "accelerator": "auto",
    "devices": 1,
}


class LoggedConfig(SaveConfigCallback):
    """Saves ``config.yaml`` beside the logs, as Lightning does, and logs every key to the run's loggers.

    Keys are the CLI's dotted keys (``model.rl.mini_batch_per_replica``), the names a W&B sweep's
    parameters use, so a run's logged params line up with the sweep that launched it (CSV: ``hparams.yaml``).
    ``model.seed`` is logged as the seed the run used (``seed_everything``'s when the config leaves it unset).
    """

    def save_config(self, trainer, pl_module, stage: str) -> None:
        params = flatten(yaml.safe_load(self.parser.dump(self.config, skip_none=False)))
        if isinstance(getattr(pl_module, "seed", None), int):
            params["model.seed"] = pl_module.seed
        for logger in trainer.loggers:
            logger.log_hyperparams(params)


class GRPOCLI(LightningCLI):
    """LightningCLI for GRPO: CSV logs under ``runs/``, a run summary, config saved and logged beside the logs.

    Differences from a stock LightningCLI, each for a reason:

    - ``fit`` and ``validate`` only (``test``/``predict`` have nothing to run); ``plot`` is listed too.
    - The model is chosen by ``--model.class_path`` (default ``GRPOModule``; any LightningModule, e.g.
      ``DPOModule``), the data module by ``--data.class_path`` (default ``PromptDataModule``);
      ``--model.help [CLASS]`` and ``--model.rl.help`` (one per section) list the knobs with their descriptions.
    - ``--optimizer`` / ``--lr_scheduler`` are refused: ``model.optim`` is the one optimizer source.
    - Config errors are reported in a few lines, not a usage dump or chained tracebacks.

    Example (a project's own entry point, with its own module)::

        GRPOCLI(MyGRPOModule)  # `python train.py fit --config my.yaml`
    """

    def __init__(
        self,
        model_class: type[LightningModule] = GRPOModule,
        datamodule_class: type[LightningDataModule] = PromptDataModule,
        *,
        subclass_mode_model: bool = True,
        subclass_mode_data: bool = True,
        auto_configure_optimizers: bool = False,
        seed_everything_default: bool | int = 0,
        trainer_defaults: dict | None = None,
        save_config_callback: type[SaveConfigCallback] | None = LoggedConfig,
        save_config_kwargs: dict | None = None,
        **kwargs,
    ) -> None:
        # In subclass mode the given classes are the defaults (a config without class_path builds them) and any
        # LightningModule / LightningDataModule may be named instead.
        self.default_classes = {"model": model_class, "data": datamodule_class}
        # a W&B logger's <save_dir>/<name> (before_instantiate_classes)
        self.experiment_dir: Path | None = None
        kwargs.setdefault("parser_class", DataKeysParser)
        quiet_litlogger_tip()
        super().__init__(
            LightningModule if subclass_mode_model else model_class,
            LightningDataModule if subclass_mode_data else datamodule_class,
            subclass_mode_model=subclass_mode_model,
            subclass_mode_data=subclass_mode_data,
            auto_configure_optimizers=auto_configure_optimizers,
            seed_everything_default=seed_everything_default,
            trainer_defaults=TRAINER_DEFAULTS
            if trainer_defaults is None
            else trainer_defaults,
            save_config_callback=save_config_callback,
            # --overwrite_run=true replaces a run's folder (run_folder.py refuses it otherwise): its config too.
            save_config_kwargs={"overwrite": True}
            if save_config_kwargs is None
            else save_config_kwargs,
            **kwargs,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # test/predict would need test_step/predict_step: a GRPO run has neither
        return {
            name: skip
            for name, skip in LightningCLI.subcommands().items()
            if name in ("fit", "validate")
        }

    def init_parser(self, **kwargs) -> ArgumentParser:
        # a field's docstring is its --help text
        set_parsing_settings(docstring_parse_attribute_docstrings=True)
        kwargs.setdefault(
            "description",
            "GRPO for PyTorch Lightning. `fit --help`: the options; `fit --model.help`: "
            "every model knob with its meaning.",
        )
        # errors come back to parse_arguments: reported in a few lines
        kwargs.setdefault("exit_on_error", False)
        return super().init_parser(**kwargs)

    def _add_subcommands(self, parser, **kwargs) -> None:
        super()._add_subcommands(parser, **kwargs)
        # `fit --help` lists data.* too, not only --data.help
        for name in self._subcommand_parsers:
            self._parser(name).appendix = (("data", self.default_classes["data"]),)
        # plot, show, certify: run by main() before LightningCLI; listed so that --help names them
        add_verbs(parser)

    def add_arguments_to_parser(self, parser) -> None:
        # Complete, atomic checkpoints once per loop step: `--checkpoint.every_n_loop_steps` (docs/checkpointing.md).
        parser.add_lightning_class_args(GRPOCheckpoint, "checkpoint")
        # A few completions per loop step in completions.jsonl / W&B / the console (`--completions.*`), and a
        # warning when the learning signal is gone (`--alarm.*`).
        parser.add_lightning_class_args(CompletionLog, "completions")
        parser.add_lightning_class_args(SignalAlarm, "alarm")
        parser.add_argument(
            "--overwrite_run",
            type=bool,
            default=False,
            help="Let a new fit replace the run in the folder an explicit "
            "trainer.logger.init_args.version names (refused otherwise).",
        )
        modes = {"model": self.subclass_mode_model, "data": self.subclass_mode_data}
        # a config without class_path builds the CLI's default class
        for key, cls in self.default_classes.items():
            if modes[key]:
                parser.set_defaults(
                    {key: {"class_path": f"{cls.__module__}.{cls.__qualname__}"}}
                )
        group = parser.add_argument_group(
            "The model's sections, each field with its description"
        )
        for key, section in SECTIONS.items():
            group.add_argument(f"--{key}.help", action=SectionHelp, section=section)
        # accepted in every form a user may try, then refused with the fix
        if not self.auto_configure_optimizers:
            add_refused_optimizer_args(parser)

    def parse_arguments(self, parser, args) -> None:
        given = args
        args = default_help_class(
            sys.argv[1:] if args is None else args, self.default_classes
        )
        if given is None and args == sys.argv[1:]:
            # LightningCLI warns ("args parameter is intended ...") when args and sys.argv both come
            args = None
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as err:
            if not self.auto_configure_optimizers and names_optimizer(err):
                config_error(f"--optimizer/--lr_scheduler: {OPTIMIZER_REFUSED}")
            # a removed field: say what replaced it
            if (retired := retired_key(str(err))) is not None:
                config_error(retired)
            config_error(err)

    def _parse_ckpt_path(self) -> None:
        # LightningCLI torch.loads --ckpt_path while parsing (for hyper-parameters): check the file first, so a missing
        # or damaged one is named with its fix instead of torch's "Unsupported operand 110".
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        try:
            if ckpt_path not in (None, "last"):
                if rank_zero_only.rank != 0 and not Path(ckpt_path).exists():
                    # rank 0's file, unseen here: every rank stops at setup, naming it (checkpoint/shared.py)
                    return
                check_ckpt_file(ckpt_path)
            super()._parse_ckpt_path()
        except RUN_ERRORS as err:
            config_error(err)
        # a zip archive, damaged inside
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            config_error(
                f"--ckpt_path={ckpt_path}: cannot be read as a checkpoint ({type(err).__name__}: {first}); "
                "the file is damaged. Resume from an earlier one (--ckpt_path=last: the newest intact one)"
            )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if not self.auto_configure_optimizers:
            for key in ("optimizer", "lr_scheduler"):
                if config.get(key) is not None:
                    config_error(f"--{key}: {OPTIMIZER_REFUSED}")
        if self.subcommand and (
            problems := check_launch(
                config.get("trainer.num_nodes"),
                config.get("trainer.devices"),
                os.environ,
            )
        ):
            # before the Trainer: Lightning's own check names no flag
            config_error("\n".join(problems))
        if self.subcommand and config.get("trainer.enable_checkpointing") is False:
            # Lightning refuses a Checkpoint then
            self._parser(self.subcommand).callback_keys.remove("checkpoint")
        # a W&B run's files get a version folder of their own (two sweep trials: two folders)
        if self.subcommand:
            self.experiment_dir = run_folder.version_wandb_logger(
                config.get("trainer.logger")
            )

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
            self._check_run()
        except LOAD_ERRORS as err:
            config_error(err)

    def _check_run(self) -> None:
        """The rules across sections, now with the Trainer's world size: before fit launches a rank or reads a weight
        (``GRPOModule.__init__`` ran those that need no world size; ``setup`` runs them again on every rank)."""
        if not isinstance(self.model, GRPOModule):
            return  # DPOModule and other modules have no rl / rollout sections
        objective = (
            self.config[self.subcommand].get("model.init_args.objective")
            if self.subcommand
            else None
        )
        named = objective if isinstance(objective, str) else None
        check_run(
            self.model.policy_cfg,
            self.model.rl,
            self.model.rollout_cfg,
            self.model.opd_cfg,
            named,
            dp_size=self.trainer.world_size,
        )

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except Exception as err:
            # that folder is another run's: leave it untouched
            if isinstance(err, RunFolderInUseError):
                raise
            if (
                reported := logged_error(getattr(self, "trainer", None), err)
            ) is not err:
                # a full disk: a RunWriteError, said in a few lines
                raise reported from err
            raise

    def before_validate(self) -> None:
        # The fit's RunSummary, so the callback states of a fit's checkpoint all find their callback: Lightning warns
        # "Please add the following callbacks: ['RunSummary']" at every `validate --ckpt_path` otherwise. It prints
        # nothing here (no training ends).
        self._add_summary()

    def before_fit(self) -> None:
        self._add_summary()
        callbacks = self.trainer.callbacks
        if isinstance(self.model, GRPOModule) and not any(
            isinstance(cb, HandoffCallback) for cb in callbacks
        ):
            # The colocated hand-off (engine sleep/wake, trainer offload, weight sync once per collected batch).
            # Without one the module would attach a sync-only publisher. Configure it under trainer.callbacks.
            self.trainer.callbacks.append(HandoffCallback())
        # Checkpoints last (Lightning's order at init): a save sees every other callback's state of this loop step.
        self.trainer.callbacks.sort(key=lambda cb: isinstance(cb, Checkpoint))
        config = self.config_init[self.subcommand]
        # before anything reads or writes the run folder (two runs at once)
        if self.trainer.is_global_zero:
            claim_versions(self.trainer.loggers)
        # "last" -> the newest complete one (a W&B run's: under every version of its experiment, on every rank)
        roots = [self.experiment_dir] if self.experiment_dir else []
        config["ckpt_path"] = resolve_ckpt_path(
            config.get("ckpt_path"), self.trainer, roots
        )
        # before anything is written: a new fit never lands on a run folder that already holds a run (run_folder.py)
        refuse_reused_version(
            self.trainer.loggers,
            explicit_version(self.config[self.subcommand].get("trainer.logger")),
            resuming=config["ckpt_path"] is not None,
            overwrite=config.get("overwrite_run", False),
        )

    def after_fit(self) -> None:
        # The run is over: stop the `vllm serve` children it launched (and their SIGTERM handler) now, not at
        # interpreter exit: a CLI called from Python (a notebook, a test suite) would keep them for the whole process.
        # In-process engines stay as before (they go with the process; closing one mid-process is the caller's call).
        engine = self.model.engine if isinstance(self.model, GRPOModule) else None
        # AsyncRollouts wraps it: both close
        if engine is not None and isinstance(unwrapped(engine), Served):
            engine.close()

    def _add_summary(self) -> None:
        if not any(isinstance(cb, RunSummary) for cb in self.trainer.callbacks):
            self.trainer.callbacks.append(RunSummary())


def flatten(tree: dict, prefix: str = "") -> dict:
    """Nested dicts -> one level of dotted keys; lists and scalars stay values.

    ``init_args`` levels are dropped (``model.init_args.rl.group_size`` -> ``model.rl.group_size``): the
    short form jsonargparse accepts on the command line, and the key a sweep's parameter uses.
    """
    flat = {}
    for key, value in tree.items():
        if key == "init_args" and isinstance(value, dict):
            flat.update(flatten(value, prefix))
        elif isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def main(args: list[str] | None = None) -> None:
    if run_verb(sys.argv[1:] if args is None else args):
        return
    # `--model.class_path my_pkg.MyModule` from the working folder, as `python -m`
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        # None: LightningCLI reads sys.argv itself (passing both warns)
        GRPOCLI(args=args)
    except RUN_ERRORS as err:
        config_error(err)


if __name__ == "__main__":
    main()
