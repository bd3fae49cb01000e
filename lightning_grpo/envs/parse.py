"""Tool calls out of a model turn's text, per chat-template family; a parser is a plain function (the hook).

A parser maps the turn's decoded text to a list of calls, each a ``ToolCall`` or an error string for a call it
recognised but could not read (bad JSON, no name): the episode answers that one with the error, so a malformed
call is feedback to the model, never a crashed rollout. Parsing reads text, but only to decide what to run: the
trained record stays the sampled token ids (``episode.py``).

``pythonic`` reads ``name(arg=value)`` calls (Llama 3.2's pythonic format). Another family: register ``PARSERS["mine"] = my_parse`` (``(text) -> list[ToolCall | str]``) before the run and
set ``model.env.parser: mine``, or give ``model.env.parser: my_pkg.module:my_parse``.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """A call the model asked for: the tool's name and its JSON arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


Parser = Callable[[str], "list[ToolCall | str]"]

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall | str]:
    """Hermes-style calls, as Qwen2.5 and Qwen3 chat templates ask for them:
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn. An unclosed last tag is
    still read (the model may have stopped on EOS right after the JSON)."""
    out: list[ToolCall | str] = []
    for body in _HERMES.findall(text):
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as e:
            out.append(
                f"Error: the tool call is not valid JSON ({e.msg} at char {e.pos}); write "
                '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'
            )
            continue
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        # some models send the arguments JSON-encoded once more
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if (
            not isinstance(call, dict)
            or not isinstance(call.get("name"), str)
            or not isinstance(args, dict)
        ):
            out.append(
                'Error: a tool call needs {"name": "<tool>", "arguments": {...}} with an object of arguments'
            )
            continue
        out.append(ToolCall(call["name"], args))
    return out


# An unclosed last call is read too: a run that stops turns on ")" gets the turn's text cut right before it.
_PYTHONIC = re.compile(r"\b([A-Za-z_]\w*)\(([^()]*)(?:\)|$)")


def parse_pythonic(text: str) -> list[ToolCall | str]:
    """Python-call style, as Llama 3.2's pythonic format writes them (brackets optional): ``add(a=1, b=2)``, keyword
    arguments with literal values. Every ``name(...)`` in the text is a call; one that is not keywords of literals
    comes back as an error; an unclosed call at the end of the text is read (the turn stopped on ``)``, which engines
    cut from the text). A vocabulary without ``<``, ``>`` or ``"`` (the tiny policies') can still spell it."""
    out: list[ToolCall | str] = []
    for name, body in _PYTHONIC.findall(text):
        try:
            call = ast.parse(f"f({body})", mode="eval").body
            if call.args or any(k.arg is None for k in call.keywords):
                raise ValueError
            out.append(
                ToolCall(
                    name, {k.arg: ast.literal_eval(k.value) for k in call.keywords}
                )
            )
        # literal_eval raises ValueError on a name or an expression
        except (SyntaxError, ValueError):
            out.append(
                f"Error: could not read the call {name}({body}); write {name}(arg=value, ...) with keyword "
                "arguments and literal values"
            )
    return out


PARSERS: dict[str, Parser] = {
    "hermes": parse_hermes,
    "qwen": parse_hermes,
    "pythonic": parse_pythonic,
}
"""Tool-call parsers by name (``model.env.parser``); add an entry for another chat-template family."""
