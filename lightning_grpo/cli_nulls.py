"""``--section.key=null`` on the command line means None, also under a subclass-mode section.

With ``--model.class_path`` (LightningCLI's subclass mode, our default) jsonargparse hands a ``str | None`` field the
string ``'None'`` for ``--model.policy.warm_start=null`` (measured: a run then asked for a warm-start task named
None). The parser puts back the None the user wrote, for the keys the command line set to a null token only.
"""

from __future__ import annotations

from jsonargparse import Namespace

NULL_TOKENS = ("null", "Null", "NULL", "~", "None")
"""What YAML (and Python) read as None on a command line."""


def explicit_nulls(args: list[str]) -> list[str]:
    """Dotted keys that ``args`` set to a null token: ``--a.b=null`` or ``--a.b null``."""
    keys = []
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        key, equals, value = arg[2:].partition("=")
        if not equals:
            value = args[i + 1] if i + 1 < len(args) else ""
        if "." in key and value in NULL_TOKENS:
            keys.append(key)
    return keys


def _holder(node: object, key: str) -> Namespace | None:
    """The namespace that holds ``key`` under ``node``: ``node`` itself, or a subclass-mode section's ``init_args``."""
    if not isinstance(node, Namespace):
        return None
    if key in node:
        return node
    init_args = node.get("init_args")
    return init_args if isinstance(init_args, Namespace) and key in init_args else None


def restore_nulls(config: Namespace, keys: list[str]) -> None:
    """Set each of ``keys`` back to None where the parse turned the user's null into its text."""
    root = config[config.subcommand] if config.get("subcommand") else config
    for key in keys:
        *parents, leaf = key.split(".")
        node = root
        for part in parents:
            holder = _holder(node, part)
            node = holder[part] if holder is not None else None
        holder = _holder(node, leaf)
        if holder is not None and holder[leaf] in NULL_TOKENS:
            holder[leaf] = None
