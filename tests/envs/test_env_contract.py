"""The environment protocol's contract (envs/environment.py), one suite over every environment form we ship or teach:
the built-in calculator (public methods as tools, a reward attribute), a ``tools`` list with a reward method, and an
environment without a reward. No engine, no model: what ``EpisodeRunner`` relies on, checked per environment."""

from __future__ import annotations

import json

import pytest

from lightning_grpo.envs.environment import episode_reward, load_env, row_of
from lightning_grpo.envs.tools import call_tool

pytestmark = pytest.mark.contract


class CounterEnv:
    """Counts up; its tools are a ``tools`` list and its reward a method (both forms the protocol allows)."""

    def __init__(self) -> None:
        self.count = 0
        self.target = 0
        self.tools = [self.step]

    def reset(self, **row) -> str | None:
        self.count = 0
        self.target = int(row.get("answer", 3))
        return f"count to {self.target}"

    def step(self, by: int) -> int:
        """Count up.

        Args:
            by: how much to add.
        """
        self.count += by
        return self.count

    def reward(self) -> float:
        return float(self.count == self.target)


class Silent:
    """No reward: the run's reward functions score its episodes."""

    def reset(self, **row) -> None:
        return None

    def echo(self, text: str) -> str:
        """Repeat a text.

        Args:
            text: what to repeat.
        """
        return text


# name -> (a good call, the reward after it on the row answer "3", or None: no reward of its own)
ENVS = {
    "calculator": (("submit", {"answer": 3}), 1.0),
    "test_env_contract:CounterEnv": (("step", {"by": 3}), 1.0),
    "test_env_contract:Silent": (("echo", {"text": "hi"}), None),
}


@pytest.fixture(params=sorted(ENVS))
def env_name(request):
    return request.param


def test_tools_have_a_json_schema_the_chat_template_can_show(env_name):
    loaded = load_env(env_name)
    assert loaded.schemas
    for schema in loaded.schemas:
        assert json.loads(json.dumps(schema)) == schema
        assert schema["type"] == "function" and schema["function"]["name"] and schema["function"]["description"]
        assert schema["function"]["parameters"]["type"] == "object"


def test_reset_takes_the_row_and_returns_text_or_none(env_name):
    env, _ = load_env(env_name).new()
    first = env.reset(**row_of("1+2=", None, "3", {"source_index": 0, "epoch": 0, "level": "easy"}))
    assert first is None or isinstance(first, str)


def test_a_good_call_answers_text_and_sets_the_reward(env_name):
    (tool, arguments), reward = ENVS[env_name]
    env, tools = load_env(env_name).new()
    env.reset(**row_of("1+2=", None, "3", {}))
    result = call_tool(tools[tool], arguments, timeout_s=5.0)
    assert isinstance(result.text, str) and not result.failed
    assert episode_reward(env) == reward


def test_bad_arguments_come_back_as_a_failed_result_never_an_exception(env_name):
    (tool, _), _ = ENVS[env_name]
    env, tools = load_env(env_name).new()
    env.reset(**row_of("1+2=", None, "3", {}))
    for arguments in ({}, {"nope": 1}):
        result = call_tool(tools[tool], arguments, timeout_s=5.0)
        assert result.failed and result.text.startswith("Error:")


def test_instances_share_no_episode_state(env_name):
    (tool, arguments), reward = ENVS[env_name]
    loaded = load_env(env_name)
    first, first_tools = loaded.new()
    second, _ = loaded.new()
    for env in (first, second):
        env.reset(**row_of("1+2=", None, "3", {}))
    call_tool(first_tools[tool], arguments, timeout_s=5.0)
    assert episode_reward(first) == reward
    assert episode_reward(second) in (None, 0.0)  # the other episode saw no call
