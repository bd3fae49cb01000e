"""The environment protocol, and loading one by name with every refusal made before the first rollout.

An environment is a class, one instance per episode (TRL's ``environment_factory`` form, which runs unchanged):

- ``reset(**row) -> str | None``: start an episode on a dataset row (its columns as keywords, plus ``prompt`` and
  ``answer``); a returned string is the first observation, appended to the prompt's last user message.
- tools: its public methods (or a ``tools`` attribute listing callables), typed, with Google-style docstrings:
  their JSON schema is what the chat template shows the model (``tools.py``).
- ``reward``: read once the episode ends (an attribute, property or no-argument method) -> float. An environment
  without one leaves the episode to the configured reward functions (``model.rewards``).
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from lightning_grpo.checks import ConfigError
from lightning_grpo.envs.parse import PARSERS, Parser
from lightning_grpo.envs.tools import Tool, make_tool, public_methods, stdlib_origin

BUILTIN_ENVS = {"calculator": "lightning_grpo.envs.calculator:CalculatorEnv"}
"""Built-in environments by name (``model.env.name``)."""


@runtime_checkable
class Environment(Protocol):
    """One episode's state; tools are its public methods (see the module docstring)."""

    def reset(self, **row: Any) -> str | None: ...


@dataclass(frozen=True)
class EnvClass:
    """A loaded environment class and the tool schemas its instances expose (the same for every instance)."""

    cls: type
    schemas: tuple[dict, ...]

    def new(self) -> tuple[Environment, dict[str, Tool]]:
        """A fresh instance and its tools by name."""
        env = self.cls()
        return env, {t.name: t for t in tools_of(env, self.cls.__name__)}


def tools_of(env: object, where: str) -> list[Tool]:
    """The tools of an environment instance: its ``tools`` attribute if it has one, else its public methods."""
    fns = getattr(env, "tools", None)
    fns = (
        list(fns)
        if isinstance(fns, (list, tuple))
        else public_methods(env, frozenset({"reset", "reward", "tools"}))
    )
    return [make_tool(fn, f"model.env={where}") for fn in fns]


def load_env(name: str) -> EnvClass:
    """The environment class ``name`` refers to (built-in or ``module:Class``), its tools checked once."""
    path = BUILTIN_ENVS.get(name, name)
    cls = _import(
        path,
        f"model.env.name={name!r}",
        f"a built-in ({', '.join(BUILTIN_ENVS)}) or 'module:Class'",
    )
    if not isinstance(cls, type) or not callable(getattr(cls, "reset", None)):
        raise ConfigError(
            f"model.env.name={name!r}: {path!r} is not a class with a reset(**row) method; an "
            "environment is a class (one instance per episode) with reset and tool methods"
        )
    try:
        probe = cls()
    except TypeError as e:
        raise ConfigError(
            f"model.env.name={name!r}: {cls.__name__}() failed ({e}); an environment is built with no "
            "arguments (TRL's environment_factory form): take the row in reset(**row)"
        ) from None
    tools = tools_of(probe, name)
    if not tools:
        raise ConfigError(
            f"model.env.name={name!r}: {cls.__name__} has no tools; give it public methods with "
            "docstrings (or a tools list)"
        )
    return EnvClass(cls, tuple(t.schema for t in tools))


def load_parser(name: str) -> Parser:
    """A tool-call parser by registered name (``parse.PARSERS``) or ``module:function``."""
    if name in PARSERS:
        return PARSERS[name]
    fn = _import(
        name,
        f"model.env.parser={name!r}",
        f"a registered parser ({', '.join(PARSERS)}) or 'module:function'",
    )
    if not callable(fn):
        raise ConfigError(
            f"model.env.parser={name!r} is not callable; a parser maps a turn's text to tool calls"
        )
    if (origin := stdlib_origin(fn)) is not None:
        # The parser reads the model's generated text: a standard-library callable there (os:system, builtins:eval,
        # subprocess:getoutput) would run that text with the user's rights. Nothing of model output is executed.
        raise ConfigError(
            f"model.env.parser={name!r} is a function of Python's standard library ({origin}), which "
            "would be handed the model's generated text; a parser is a function of your own module, "
            "`def parse(text: str) -> list[ToolCall | str]`, or a registered name "
            f"({', '.join(PARSERS)})"
        )
    return fn


class EnvProtocolError(RuntimeError):
    """An environment broke its protocol mid-run (what ``reset`` returned, a non-finite reward); the message names
    the class, what it returned and the fix."""


def first_observation(env: object, row: dict) -> str | None:
    """``env.reset(**row)``: the episode's first observation, a string or None; anything else is refused.

    Gymnasium's ``reset`` returns ``(observation, info)`` and some environments a dict: formatted into the prompt as
    text, that would train the policy on a repr without a word.
    """
    observation = env.reset(**row)
    if observation is not None and not isinstance(observation, str):
        name = type(env).__name__
        raise EnvProtocolError(
            f"{name}.reset returned a {type(observation).__name__} ({_short(observation)}); reset "
            "returns the first observation as a str (appended to the prompt) or None. Return "
            f"the text (keep other state on self), e.g. `return obs['text']`"
        )
    return observation


def episode_reward(env: object) -> float | None:
    """The environment's episode reward (attribute, property or method), or None when it defines none.

    A NaN or inf is refused, as a reward function's is: it would make the loop step's loss non-finite, its update
    would be skipped, and skipped steps do not count toward ``trainer.max_steps`` (the run ran on past it).
    """
    reward = getattr(env, "reward", None)
    reward = reward() if callable(reward) else reward
    if reward is None:
        return None
    value = float(reward)
    if not math.isfinite(value):
        raise EnvProtocolError(
            f"{type(env).__name__}.reward is {value} for an episode of model.env; an episode "
            "reward must be a finite number (None leaves the episode to model.rewards)"
        )
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def row_of(
    prompt_text: str,
    messages: list[dict] | None,
    answer: str | None,
    meta: Mapping[str, Any],
) -> dict:
    """The keywords ``reset`` receives: the dataset row's columns, its prompt and its answer."""
    row = {k: v for k, v in meta.items() if k not in ("source_index", "epoch")}
    row["prompt"] = messages if messages is not None else prompt_text
    if answer is not None:
        row["answer"] = answer
    return row


def _import(path: str, where: str, expected: str) -> Any:
    if ":" not in path:
        raise ConfigError(f"{where}: not {expected}")
    module_name, attr = path.split(":", 1)
    # a console script's sys.path lacks the working folder
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    # an import error inside the user's module is theirs to see, with its type
    except Exception as e:
        raise ConfigError(
            f"{where}: cannot import module {module_name!r} ({type(e).__name__}: {e}); it must be "
            f"importable from the working folder {os.getcwd()} or an installed package"
        ) from e
    if not hasattr(module, attr):
        raise ConfigError(f"{where}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)
