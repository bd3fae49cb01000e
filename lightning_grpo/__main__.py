"""``lightning-grpo`` and ``python -m lightning_grpo``: the console entry point.

``lightning-grpo --help`` and ``lightning-grpo fit --help`` are answered here, before anything imports Lightning
(seconds of CPU: torch, torchmetrics, and the transformers and matplotlib that torchmetrics imports); everything
else goes to ``cli.main`` (LightningCLI). Both texts are the CLI's own output at 80 columns, checked by
tests/test_cli_help.py: ``TOP_HELP`` below, and ``fit_help.txt`` (written by ``tools/write_fit_help.py``), which is
printed only under the Lightning and jsonargparse versions it was recorded with (any other install asks the parser).
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

HELP_FLAGS = (["-h"], ["--help"])
FIT_HELP_FLAGS = (["fit", "-h"], ["fit", "--help"])
FIT_HELP = Path(__file__).with_name("fit_help.txt")
"""The first line names the versions it was recorded under (``recorded_under``), the rest is the help."""

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


def recorded_under() -> str:
    """``fit_help.txt``'s first line for this install: the versions whose parser the text is the output of."""
    versions = " ".join(
        f"{name}=={metadata.version(name)}" for name in ("lightning", "jsonargparse")
    )
    return f"# lightning-grpo fit --help at 80 columns, {versions} (tools/write_fit_help.py)"


def fit_help() -> str | None:
    """The recorded ``fit --help``, or None where this install's parser could print another (other versions)."""
    header, _, text = FIT_HELP.read_text().partition("\n")
    return text if header == recorded_under() else None


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv in HELP_FLAGS:
        sys.stdout.write(TOP_HELP)
        return
    if argv in FIT_HELP_FLAGS and (text := fit_help()) is not None:
        sys.stdout.write(text)
        return
    from lightning_grpo.cli import main as cli_main

    cli_main(args)


if __name__ == "__main__":
    main()
