"""What ``lightning-grpo fit`` prints for help: one config section's fields, and the data keys.

``fit --help`` lists the Trainer's and the callbacks' keys, but a subclass-mode section (``--data``) shows only
``--data.help``: ``DataKeysParser`` appends the keys of the default data module (``data.source``, ...) with
their descriptions. The top-level help is ``__main__.TOP_HELP`` (printed without importing Lightning).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from jsonargparse import ArgumentParser
from lightning.pytorch.cli import LightningArgumentParser

from lightning_grpo.cli_nulls import explicit_nulls, restore_nulls
from lightning_grpo.config import (
    GRPOConfig,
    OptimConfig,
    RolloutConfig,
    ServerConfig,
    VLLMConfig,
)
from lightning_grpo.data.rewards import RewardSpec
from lightning_grpo.dpo import DPOConfig
from lightning_grpo.objectives.opd import OPDConfig
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.tiny.spec import TinyPolicySpec

SECTIONS = {
    "model.policy": PolicyConfig,
    "model.policy.tiny": TinyPolicySpec,
    "model.rl": GRPOConfig,
    "model.optim": OptimConfig,
    "model.rollout": RolloutConfig,
    "model.rollout.vllm": VLLMConfig,
    "model.rollout.server": ServerConfig,
    "model.rewards": RewardSpec,
    "model.opd": OPDConfig,
    "model.opd.teacher": PolicyConfig,
    "model.dpo": DPOConfig,
}
"""``--<key>.help`` prints the fields of that section with their descriptions (``--model.help`` shows them all)."""


class SectionHelp(argparse.Action):
    """``--model.rl.help``: the fields of one config section with their descriptions, then exit."""

    def __init__(self, option_strings, dest, section: type, **kwargs) -> None:
        self.section = section
        super().__init__(
            option_strings,
            dest,
            nargs=0,
            default=argparse.SUPPRESS,
            help=f"Show the fields of {section.__name__} with their descriptions and exit.",
        )

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        key = option_string.removeprefix("--").removesuffix(".help")
        parser_of(self.section, key, parser.prog).print_help()
        parser.exit()


class DataKeysParser(LightningArgumentParser):
    """A subcommand parser whose help ends with the keys of ``appendix`` classes (``data.*`` of the default data
    module): a subclass-mode section lists none of its keys itself."""

    appendix: tuple[tuple[str, type], ...] = ()
    """``(key, class)`` pairs whose init arguments close the help (set on the ``fit`` / ``validate`` parsers)."""

    def parse_args(self, args=None, namespace=None, **kwargs):
        config = super().parse_args(args, namespace, **kwargs)
        restore_nulls(
            config, explicit_nulls(sys.argv[1:] if args is None else list(args))
        )
        return config

    def format_help(self) -> str:
        text = super().format_help()
        # built on demand: a run that asks no help pays nothing
        for key, cls in self.appendix:
            keys = parser_of(cls, key, self.prog).format_help()
            text += (
                f"\n{key}.* keys of {cls.__name__} (the default --{key}.class_path):\n"
            )
            text += keys.split("\n\n", 1)[-1]  # without its usage line
        return text


def default_help_class(args, default_classes: dict[str, type]):
    """``args`` where ``--model.help`` / ``--data.help`` name no class: the CLI's default one (``default_classes``
    by key), so the help describes it, not the LightningModule base."""
    if not isinstance(args, (list, tuple)):
        return args
    args = list(args)
    for key, cls in default_classes.items():
        flag = f"--{key}.help"
        if flag in args and (
            args.index(flag) + 1 == len(args)
            or args[args.index(flag) + 1].startswith("-")
        ):
            args.insert(args.index(flag) + 1, f"{cls.__module__}.{cls.__qualname__}")
    return args


def parser_of(cls: type, key: str, prog: str) -> ArgumentParser:
    """A parser holding ``cls``'s init arguments under ``key`` (their docstrings as help)."""
    section = ArgumentParser(prog=prog, description=f"{key}: {cls.__name__}")
    section.add_class_arguments(cls, key)
    return section


FIT_HELP_PROBE = "import sys; sys.argv[0] = 'lightning-grpo'; from lightning_grpo.cli import main; main(['fit', '--help'])"
"""``lightning-grpo fit --help`` through the parser (``cli.main``), as the console script runs it."""


def fresh_fit_help() -> str:
    """What the parser prints for ``lightning-grpo fit --help`` at 80 columns, from a fresh interpreter: the help
    lists the callback classes imported so far as known subclasses, so an interpreter that imported more (a test
    session) prints more. ``__main__.fit_help`` prints this text (``tools/write_fit_help.py`` records it)."""
    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run(
        [sys.executable, "-c", FIT_HELP_PROBE],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"fit --help exited with {done.returncode}: {done.stderr[-2000:]}"
        )
    return done.stdout
