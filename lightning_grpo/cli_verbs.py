"""The verbs beside ``fit`` and ``validate``: ``plot``, ``show`` and ``certify``, run before LightningCLI.

Each is answered by a module of its own without building a LightningCLI; ``add_verbs`` lists them among the
CLI's subcommands, so that ``lightning-grpo --help`` names them.
"""

from __future__ import annotations

import sys

from jsonargparse import ArgumentParser

from lightning_grpo.plot import DESCRIPTION as PLOT_DESCRIPTION
from lightning_grpo.plot import build_parser as plot_parser
from lightning_grpo.plot import main as plot_main


def add_verbs(parser: ArgumentParser) -> None:
    """List the verbs among ``parser``'s subcommands (for its help; ``run_verb`` runs them)."""
    parser._subcommands_action.add_subcommand(
        "plot", plot_parser(ArgumentParser), help=PLOT_DESCRIPTION
    )
    # `show` too: lazily, it is a light module of its own
    from lightning_grpo import show

    parser._subcommands_action.add_subcommand(
        "show", show.build_parser(ArgumentParser), help=show.DESCRIPTION
    )
    from lightning_grpo import certify_cli

    parser._subcommands_action.add_subcommand(
        "certify",
        certify_cli.build_parser(ArgumentParser),
        help=certify_cli.DESCRIPTION,
    )


def run_verb(argv: list[str]) -> bool:
    """Run the verb ``argv`` starts with (``plot``, ``show``, ``certify``); False when it names none."""
    if argv and argv[0] == "plot":
        plot_main(argv[1:])
        return True
    # before LightningCLI, and without its imports: answers at once
    if argv and argv[0] == "show":
        from lightning_grpo.show import main as show_main

        show_main(argv[1:])
        return True
    # imported here: the verb loads a policy and perhaps vLLM
    if argv and argv[0] == "certify":
        from lightning_grpo.certify_cli import main as certify_main

        sys.exit(certify_main(argv[1:]))
    return False
