"""The one way a config dataclass refuses bad values: every broken rule at once, in one ``ConfigError``.

Each config dataclass lists its problems as ``field=value: rule; fix`` lines and hands them to
``raise_problems``, which raises nothing when the list is empty. Rules of one section run at
construction (``__post_init__``), so jsonargparse and any Python caller refuse a bad config before a
model is built; rules that need the data-parallel size run again in ``validate(dp_size)``. A field that
was removed is refused by name with what replaces it (``retire``), from Python and from the CLI.

Imports nothing from the package, so every module can use it without a cycle.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Sequence


class ConfigError(ValueError):
    """A config broke one or more rules; the message lists each as ``field=value: rule``.

    Args:
        message: the whole report (what the user sees).
        problems: the report's lines, one per broken rule (empty when raised with a message only).
    """

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems)


def raise_problems(where: str, problems: Iterable[str]) -> None:
    """Raise one ``ConfigError`` listing every line of ``problems`` (none: return)."""
    problems = list(problems)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        plural = "s" * (len(problems) > 1)
        raise ConfigError(
            f"invalid {where} ({len(problems)} problem{plural}):\n{lines}", problems
        )


RETIRED: dict[str, str] = {}
"""``section.field`` -> why it was removed and what to set instead, for every field ``retire`` removed."""


def retire(section: str, where: str, **fields: str):
    """Class decorator: refuse each retired field name (a keyword of ``fields``) with its message.

    The message names ``<section>.<field>`` and what to use instead; any other problem of the same call is
    listed with it in one ``ConfigError`` (``invalid <where>``). The CLI reports a retired key in a config
    file or flag with the same message (``RETIRED``).
    """

    def decorate(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs) -> None:
            gone = [
                f"{name}={kwargs.pop(name)!r}: {RETIRED[f'{section}.{name}']}"
                for name in list(kwargs)
                if name in fields
            ]
            try:
                init(self, *args, **kwargs)
                problems = []
            except ConfigError as err:
                if not (gone and err.problems):
                    raise
                problems = err.problems
            # outside the except: one error, not a chain of two
            raise_problems(where, gone + problems)

        for name, message in fields.items():
            # the CLI prints the message alone: it must name the key
            if f"{section}.{name}" not in message:
                raise TypeError(
                    f"retire({section!r}, {name}=...): the message must name {section}.{name}"
                )
            RETIRED[f"{section}.{name}"] = message
        cls.__init__ = __init__
        return cls

    return decorate


def retired_key(text: str) -> str | None:
    """The message of the first retired field that ``text`` (a jsonargparse parse error) names, else None.

    jsonargparse names an unknown key as ``--rl.grad_accum=4`` (a flag) or ``Group 'rl' does not accept option
    'grad_accum'`` (a config file).
    """
    for key, message in RETIRED.items():
        section, name = key.rsplit(".", 1)
        if (
            re.search(rf"(?<!\w){re.escape(key)}\b", text)
            or f"'{section}' does not accept option '{name}'" in text
        ):
            return message
    return None


def is_int(x: object) -> bool:
    """An integer, and not a bool (YAML ``true`` is no count)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_finite(x: object) -> bool:
    """A finite real number, and not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
