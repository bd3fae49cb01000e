"""How the CLI reports an error a user can fix: in a few lines on stderr, exit status 2.

A config error, or one a user causes mid-run (``errors.USER_ERRORS``), is printed as its message, not a usage
dump or a chain of tracebacks; ``LIGHTNING_GRPO_DEBUG=1`` raises it as is.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_grpo.config import ConfigError
from lightning_grpo.data.sources import PromptDataError
from lightning_grpo.determinism import DeterminismError
from lightning_grpo.errors import USER_ERRORS, RunWriteError
from lightning_grpo.run_folder import RunFolderInUseError

DEBUG_ENV = "LIGHTNING_GRPO_DEBUG"
"""Set to 1 to get the full traceback of a config error instead of its short report."""
LOAD_ERRORS = (ValueError, TypeError, OSError, ImportError, MisconfigurationException)
"""Raised while the config's classes are built: the config is wrong (a bug shows its traceback with DEBUG_ENV)."""
RUN_ERRORS = (
    ConfigError,
    PromptDataError,
    DeterminismError,
    MisconfigurationException,
    RunFolderInUseError,
    *USER_ERRORS,
)
"""Config errors only the run can find (per-rank sizes need the DP size, data load at setup, Lightning's checks),
and what a user causes mid-run (a reward function that raises, a damaged checkpoint: ``errors.py``)."""
_PACKAGE = str(Path(__file__).parent)
_UNION_NOISE = re.compile(
    r"Does not validate against any of the Union subtypes|^\s*Subtypes: |^\s*Errors:$|"
    r"Expected a <class 'NoneType'>|NestedArg"
)
"""Lines of a jsonargparse parse error about the ``None`` alternative of an optional section (the model's)."""


def config_error(err: BaseException | str) -> NoReturn:
    """Report a config error in a few lines on stderr and exit 2 (``LIGHTNING_GRPO_DEBUG=1``: raise it instead)."""
    if isinstance(err, BaseException) and os.environ.get(DEBUG_ENV, "") not in (
        "",
        "0",
    ):
        raise err
    message = (
        err
        if isinstance(err, str)
        else str(err)
        if isinstance(err, RunWriteError)
        else _innermost_message(err)
    )
    logged = [
        n for n in getattr(err, "__notes__", ()) if n.startswith("full traceback: ")
    ]
    where = (
        f"{logged[0]} or {DEBUG_ENV}=1" if logged else f"full traceback: {DEBUG_ENV}=1"
    )
    sys.stderr.write(
        f"lightning-grpo: error: {message.strip()}\n"
        f"  (all options: lightning-grpo fit --help; {where})\n"
    )
    raise SystemExit(2)


def _innermost_message(err: BaseException) -> str:
    """The message of the error our code raised: jsonargparse re-raises a class's own error inside its own."""
    # jsonargparse's parse errors name the key and what was expected
    if isinstance(err, argparse.ArgumentError):
        return "\n".join(
            line for line in str(err).splitlines() if not _UNION_NOISE.search(line)
        )
    chain = [err]
    # `raise ... from None` hides the context on purpose: the message raised already says all of it
    while (
        cause := chain[-1].__cause__
        or (None if chain[-1].__suppress_context__ else chain[-1].__context__)
    ) is not None and cause not in chain:
        chain.append(cause)
    ours = [
        e
        for e in chain
        if e.__traceback__
        and _PACKAGE in traceback.extract_tb(e.__traceback__)[-1].filename
    ]
    origin = ours[-1] if ours else err
    return (
        str(origin)
        if isinstance(origin, ValueError)
        else f"{type(origin).__name__}: {origin}"
    )
