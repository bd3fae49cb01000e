"""Tools: typed Python callables whose docstring is the schema the chat template shows the model.

The schema comes from ``transformers.utils.get_json_schema`` (Google-style docstring, type hints), the form
``apply_chat_template(tools=...)`` expects. A tool the schema cannot describe (no docstring, an argument type
outside JSON) is refused when the environment is loaded, never at the first call. A call never raises into the
rollout: a bad argument, a raising tool or one over its timeout returns an error string to the model and
counts as a failure (``tools/failure_frequency``).
"""

from __future__ import annotations

import inspect
import sys
import threading
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lightning_grpo.checks import ConfigError

# JSON schema type -> the Python values that satisfy it (bool is an int in Python: excluded by hand below).
_JSON_TYPES = {
    "integer": (int,),
    "number": (int, float),
    "string": (str,),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class Tool:
    """One callable tool and its JSON schema (``{"type": "function", "function": {...}}``)."""

    fn: Callable[..., Any]
    schema: dict

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


@dataclass(frozen=True)
class ToolResult:
    """What a call returns to the model (always text) and whether it failed."""

    text: str
    failed: bool


def make_tool(fn: Callable[..., Any], where: str) -> Tool:
    """``fn`` as a ``Tool``; raises ``ConfigError`` naming ``where`` and the fix when its schema cannot be built."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import (
        DocstringParsingException,
        TypeHintParsingException,
    )

    name = getattr(fn, "__name__", repr(fn))
    # os.system, eval, subprocess.getoutput: the model's text, run
    if (origin := stdlib_origin(fn)) is not None:
        raise ConfigError(
            f"{where}: tool {name!r} is a function of Python's standard library ({origin}), which would "
            "be called with the model's generated arguments; a tool is a method (or function) of your "
            "own, with typed arguments and a docstring"
        )
    bad_type = (
        f"{where}: tool {name!r} has an argument type JSON cannot carry ({{}}). Type every argument as int, "
        "float, str, bool, list[...], dict[str, ...], Literal[...] or an Optional of them"
    )
    try:
        hints = typing.get_type_hints(fn)
    except NameError as e:
        raise ConfigError(bad_type.format(e)) from None
    bad = [
        f"{arg}: {hint}"
        for arg, hint in hints.items()
        if arg != "return" and not _is_json(hint)
    ]
    # get_json_schema calls an unknown class "object": the tool would receive a dict, not its type
    if bad:
        raise ConfigError(bad_type.format(", ".join(bad)))
    try:
        return Tool(fn, get_json_schema(fn))
    except DocstringParsingException as e:
        raise ConfigError(
            f"{where}: tool {name!r} cannot be described to the model ({e}). Give it a Google-style "
            "docstring: a description line, then an 'Args:' section with one line per argument"
        ) from None
    except TypeHintParsingException as e:
        raise ConfigError(bad_type.format(e)) from None


def stdlib_origin(fn: Callable[..., Any]) -> str | None:
    """The standard-library module ``fn`` comes from (``posix`` for ``os.system``, ``builtins`` for ``eval``), else
    None: such a callable must never be handed what the model generated (as a tool or as a parser)."""
    origin = (getattr(fn, "__module__", None) or "builtins").split(".")[0]
    return origin if origin == "builtins" or origin in sys.stdlib_module_names else None


def _is_json(hint: Any) -> bool:
    """Whether arguments typed ``hint`` arrive as they are from JSON (the types the tool's schema can state)."""
    if hint in (int, float, str, bool, list, dict, tuple, type(None), Any):
        return True
    origin = typing.get_origin(hint)
    if origin is Literal:
        return True
    if origin in (list, tuple, dict, typing.Union, types.UnionType):
        return all(a is Ellipsis or _is_json(a) for a in typing.get_args(hint))
    return False


def public_methods(
    obj: object, skip: frozenset[str] = frozenset({"reset", "reward"})
) -> list[Callable[..., Any]]:
    """The tools of a TRL ``environment_factory`` instance: its public methods other than ``skip``, in name order."""
    out = []
    for name in sorted(dir(type(obj))):
        if name.startswith("_") or name in skip:
            continue
        attr = inspect.getattr_static(type(obj), name)
        if isinstance(attr, (staticmethod, classmethod)) or inspect.isfunction(attr):
            out.append(getattr(obj, name))
    return out


def bad_arguments(tool: Tool, arguments: Mapping[str, Any]) -> str | None:
    """Why ``arguments`` do not fit the tool's schema (missing, unknown, wrong JSON type), or None when they do."""
    params = tool.schema["function"].get("parameters", {})
    props = params.get("properties", {})
    required = params.get("required", [])
    missing = [a for a in required if a not in arguments]
    unknown = [a for a in arguments if a not in props]
    if missing or unknown:
        return f"missing arguments {missing}, unknown arguments {unknown}; expected {sorted(props)}"
    for key, value in arguments.items():
        kinds = props[key].get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds or []
        fits = any(
            isinstance(value, _JSON_TYPES.get(k, object))
            and not (isinstance(value, bool) and k in ("integer", "number"))
            for k in kinds
        )
        if kinds and not fits:
            return f"argument {key!r}={value!r} is not of type {'/'.join(kinds)}"
    return None


def call_tool(tool: Tool, arguments: Mapping[str, Any], timeout_s: float) -> ToolResult:
    """Run ``tool(**arguments)`` with a timeout; every failure comes back as an ``Error: ...`` string.

    The call runs in a daemon thread: a tool past its timeout cannot be killed (Python threads have no cancel),
    it is abandoned and keeps its thread until it returns. A tool that may hang should time out on its own too.
    """
    problem = bad_arguments(tool, arguments)
    if problem is not None:
        return ToolResult(f"Error: bad arguments for {tool.name}: {problem}", True)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = tool.fn(**arguments)
        # noqa: BLE001 -- a raising tool is the model's feedback, not a crashed rollout
        except Exception as e:
            box["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=run, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return ToolResult(f"Error: {tool.name} timed out after {timeout_s:g} s", True)
    if "error" in box:
        return ToolResult(f"Error: {tool.name} raised {box['error']}", True)
    return ToolResult(str(box.get("value")), False)
