"""Tool calls out of a model turn's text, per chat-template family; a parser is a plain function (the hook).

A parser maps the turn's decoded text to a list of calls, each a ``ToolCall`` or an error string for a call it
recognised but could not read (bad JSON, no name): the episode answers that one with the error, so a malformed
call is feedback to the model, never a crashed rollout. Parsing reads text, but only to decide what to run: the
trained record stays the sampled token ids (``episode.py``).

Another family: register ``PARSERS["mine"] = my_parse`` (``(text) -> list[ToolCall | str]``) before the run and
set ``model.env.parser: mine``, or give ``model.env.parser: my_pkg.module:my_parse``.
"""

from __future__ import annotations

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
            out.append(f"Error: the tool call is not valid JSON ({e.msg} at char {e.pos}); write "
                       '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>')
            continue
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(args, str):  # some models send the arguments JSON-encoded once more
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(args, dict):
            out.append('Error: a tool call needs {"name": "<tool>", "arguments": {...}} with an object of arguments')
            continue
        out.append(ToolCall(call["name"], args))
    return out


PARSERS: dict[str, Parser] = {"hermes": parse_hermes, "qwen": parse_hermes}
"""Tool-call parsers by name (``model.env.parser``); add an entry for another chat-template family."""
