"""``lightning-grpo`` and ``python -m lightning_grpo``: the console entry point.

``lightning-grpo --help`` is answered here, before anything imports Lightning (seconds of CPU: torch,
torchmetrics, and the transformers and matplotlib that torchmetrics imports); everything else goes to
``cli.main`` (LightningCLI).
"""

from __future__ import annotations

import sys

HELP_FLAGS = (["-h"], ["--help"])

TOP_HELP = """\
usage: lightning-grpo [-c CONFIG] {fit,validate,plot,show,certify} ...

GRPO for PyTorch Lightning. `fit --help`: the options; `fit --model.help`:
every model knob with its meaning.

options:
  -h, --help            Show this help message and exit.
  -c CONFIG, --config CONFIG
                        Path to a configuration file in json or yaml format.
  --print_config [=flags]
                        Print the configuration after applying all other
                        arguments and exit. The optional flags customizes the
                        output and are one or more keywords separated by
                        comma. The supported flags are: skip_default,
                        skip_unset.

subcommands:
  For more details of each subcommand, add it as an argument followed by
  --help.

  Available subcommands:
                        (required)
    fit                 Runs the full optimization routine.
    validate            Perform one evaluation epoch over the validation set.
    plot                Draw reward, loss, KL, clip fraction, completion
                        length and tool use (DPO: loss, accuracy, margin) of a
                        CSVLogger run into one PNG.
    show                Print the completions (whole episodes with model.env)
                        of one loop step of a run.
    certify             The consistency certificate of a run's policy and
                        engine (engine vs trainer, whole vocabulary).
"""
"""``lightning-grpo --help`` (tests/test_cli.py checks it against ``GRPOCLI``'s own parser)."""


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv in HELP_FLAGS:
        sys.stdout.write(TOP_HELP)
        return
    from lightning_grpo.cli import main as cli_main

    cli_main(args)


if __name__ == "__main__":
    main()
