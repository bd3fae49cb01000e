"""``lightning-grpo``: the LightningCLI entry point (``fit``, ``validate``, ``--print_config``) and ``plot``.

Every knob is a dotted key (``--model.rl.micro_batch_per_replica=8``), so YAML configs and
``wandb sweep`` drive the same surface.
"""

from __future__ import annotations

import sys

import yaml
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

from lightning_grpo.checkpoint import GRPOCheckpoint, resolve_ckpt_path
from lightning_grpo.data.prompts import PromptDataModule
from lightning_grpo.handoff import HandoffCallback
from lightning_grpo.module import GRPOModule
from lightning_grpo.summary import RunSummary

TRAINER_DEFAULTS = {
    # Under manual optimization Lightning counts logging in batches = loop steps: log every one.
    "log_every_n_steps": 1,
    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs"}},
    "max_steps": 20,
    "accelerator": "auto",
    "devices": 1,
}


class GRPOCLI(LightningCLI):
    """LightningCLI with our defaults: CSV logs under ``runs/``, a run summary, config saved beside the logs."""

    def add_arguments_to_parser(self, parser) -> None:
        # Complete, atomic checkpoints once per loop step: `--checkpoint.every_n_loop_steps` (docs/checkpointing.md).
        parser.add_lightning_class_args(GRPOCheckpoint, "checkpoint")

    def before_instantiate_classes(self) -> None:
        if self.subcommand and self.config[self.subcommand].get("trainer.enable_checkpointing") is False:
            self._parser(self.subcommand).callback_keys.remove("checkpoint")  # Lightning refuses a Checkpoint then

    def before_fit(self) -> None:
        if not any(isinstance(cb, RunSummary) for cb in self.trainer.callbacks):
            self.trainer.callbacks.append(RunSummary())
        if not any(isinstance(cb, HandoffCallback) for cb in self.trainer.callbacks):
            # The colocated hand-off (engine sleep/wake, trainer offload, weight sync once per collected batch).
            # Without one the module would attach a sync-only publisher. Configure it under trainer.callbacks.
            self.trainer.callbacks.append(HandoffCallback())
        # Checkpoints last (Lightning's order at init): a save sees every other callback's state of this loop step.
        self.trainer.callbacks.sort(key=lambda cb: isinstance(cb, Checkpoint))
        config = self.config_init[self.subcommand]
        config["ckpt_path"] = resolve_ckpt_path(config.get("ckpt_path"), self.trainer)  # "last" -> newest complete


class LoggedConfig(SaveConfigCallback):
    """Saves ``config.yaml`` beside the logs, as Lightning does, and logs every key to the run's loggers.

    Keys are the CLI's dotted keys (``model.rl.mini_batch_per_replica``), the names a W&B sweep's
    parameters use, so a run's logged params line up with the sweep that launched it (CSV: ``hparams.yaml``).
    """

    def save_config(self, trainer, pl_module, stage: str) -> None:
        params = flatten(yaml.safe_load(self.parser.dump(self.config, skip_none=False)))
        for logger in trainer.loggers:
            logger.log_hyperparams(params)


def flatten(tree: dict, prefix: str = "") -> dict:
    """Nested dicts -> one level of dotted keys; lists and scalars stay values."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] == "plot":
        from lightning_grpo.plot import main as plot_main

        plot_main(argv[1:])
        return
    GRPOCLI(
        GRPOModule,
        PromptDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=0,
        # Sweeps re-run in one directory: overwrite the saved config instead of aborting.
        save_config_kwargs={"overwrite": True},
        save_config_callback=LoggedConfig,
        args=args,  # None: LightningCLI reads sys.argv itself (passing both warns)
    )


if __name__ == "__main__":
    main()
