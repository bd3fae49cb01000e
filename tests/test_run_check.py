"""Every rule across config sections (``run_check.py``) fires before the policy loads, through the CLI and through
``GRPOModule`` + a Trainer; and a retired ``rl`` key is refused by name with what to do instead."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from PIL import Image

import lightning_grpo.base
import lightning_grpo.policy
from lightning_grpo.cli import main
from lightning_grpo.config import ConfigError, GRPOConfig, RolloutConfig, ServerConfig
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.run_check import check_run

QUICKSTART = str(Path(__file__).parents[1] / "configs" / "quickstart.yaml")
SERVER = "--model.rollout.engine=vllm_server"
TIS = "--model.rl.rollout_correction.mode=tis"

# (overrides of the quickstart, a fragment of the refusal naming the knob). Each row breaks exactly one rule.
RULES = {
    "sampler_logprobs": (["--model.rollout.engine=vllm", "--model.rollout.vllm.logprobs_mode=raw_logprobs",
                          "--model.rollout.temperature=0.7", TIS],
                         "rollout.vllm.logprobs_mode='raw_logprobs': with rl.rollout_correction.mode='tis'"),
    "overlong": (["--model.rl.overlong_buffer=4"], "rl.overlong_buffer=4: must be below rollout.max_new_tokens=4"),
    "async_uncorrected": ([SERVER, "--model.rollout.max_off_policy_steps=1"],
                          "rollout.max_off_policy_steps=1: .*set rl.rollout_correction.mode: tis"),
    "restarts_ranks": ([SERVER, "--model.rollout.server.restarts=1", "--trainer.devices=2", "--trainer.strategy=ddp"],
                       "rollout.server.restarts=1 with 2 trainer ranks: .*set rollout.server.restarts: 0"),
    "inflight_in_process": (["--model.rollout.server.inflight_updates=true"],
                            "server.inflight_updates=True with engine='hf': .*set engine: vllm_server"),
    "inflight_ranks": ([SERVER, TIS, "--model.rollout.max_off_policy_steps=1",
                        "--model.rollout.server.inflight_updates=true", "--trainer.devices=2", "--trainer.strategy=ddp"],
                       "rollout.server.inflight_updates=True with 2 trainer ranks: .*inflight_updates: false"),
    "lora_adapter_http": ([SERVER, "--model.rollout.server.weight_transport=http", "--model.policy.lora.sync=adapter"],
                          "policy.lora.sync=adapter with rollout.server.weight_transport=http: .*set policy.lora.sync"),
    "opd_section": (["--model.opd.teacher.path=tiny:teacher"],
                    "objective='grpo' but the opd section is set.*set model.objective=opd"),
    "opd_rules": (["--model.objective=opd", "--model.rl.beta=0.1"], "opd.teacher=None: objective=opd needs a teacher"),
    "routing_rollout": (["--model.rl.routing_replay=rollout"],
                        "rl.routing_replay='rollout' with rollout.engine='hf': the 'hf' engine returns no"),
}


@pytest.fixture
def no_policy(monkeypatch):
    """Loading the policy fails the test: every refusal must come first."""

    def load_policy(*args, **kwargs):
        raise AssertionError("policy loaded")

    monkeypatch.setattr(lightning_grpo.policy, "load_policy", load_policy)
    monkeypatch.setattr(lightning_grpo.base, "load_policy", load_policy)  # UpdateModule.configure_policy


@pytest.mark.parametrize("rule", list(RULES))
def test_each_rule_fires_in_the_cli_before_the_policy_loads(rule, no_policy, tmp_path, monkeypatch):
    overrides, says = RULES[rule]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIGHTNING_GRPO_DEBUG", "1")  # the ValueError itself, not the short report's SystemExit
    with pytest.raises(ValueError, match=says):
        main(["fit", "--config", QUICKSTART, "--trainer.logger=false", *overrides])


def test_the_rank_rule_fires_in_setup_before_the_policy_loads(no_policy):
    """From Python (no CLI) the Trainer's world size is known at setup, before configure_model builds the policy."""
    rollout = RolloutConfig(engine="vllm_server", server=ServerConfig(restarts=1))
    module = GRPOModule(policy=PolicyConfig(path="tiny:quickstart"), rollout=rollout)
    module.trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, logger=False)
    with pytest.raises(ConfigError, match="rollout.server.restarts=1 with 2 trainer ranks"):
        module.setup("fit")
    assert module.policy is None


def test_every_problem_is_reported_at_once():
    rl = GRPOConfig(overlong_buffer=40, routing_replay="rollout")
    rollout = RolloutConfig(engine="vllm_server", max_off_policy_steps=1, server=ServerConfig(restarts=1))
    with pytest.raises(ConfigError, match=r"invalid run config \(4 problems\)") as err:
        check_run(PolicyConfig(), rl, rollout, dp_size=2)
    knobs = [p.split("=")[0] for p in err.value.problems]
    assert knobs == ["rl.overlong_buffer", "rollout.max_off_policy_steps", "rollout.server.restarts",
                     "rl.routing_replay"]


def test_restarts_with_async_rollouts_are_accepted():
    """Async rollouts restart safely (the training thread recovers, the worker idle: tests/rollout/
    test_server_restarts.py); only several ranks stay refused."""
    rollout = RolloutConfig(engine="vllm_server", max_off_policy_steps=1, server=ServerConfig(restarts=1))
    check_run(PolicyConfig(), GRPOConfig(rollout_correction={"mode": "tis"}), rollout, dp_size=1)


def test_an_objective_instance_brings_its_own_config():
    """objective=None (an Objective built in Python): the opd section's rules do not apply."""
    from lightning_grpo.objectives.opd import OPDConfig

    opd = OPDConfig(teacher=PolicyConfig(path="tiny:teacher"))
    check_run(PolicyConfig(), GRPOConfig(), RolloutConfig(), opd, objective=None)
    with pytest.raises(ConfigError, match="set model.objective=opd"):
        check_run(PolicyConfig(), GRPOConfig(), RolloutConfig(), opd)


@pytest.mark.parametrize("how", ["python", "flag", "yaml"])
def test_the_derived_needs_cached_old_logprobs_is_refused_by_name(how, tmp_path, capsys):
    says = "rl.needs_cached_old_logprobs was removed: it was derived, never a knob"
    if how == "python":
        with pytest.raises(ConfigError, match=says):
            GRPOConfig(needs_cached_old_logprobs=True)
        return
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  rl:\n    needs_cached_old_logprobs: true\n")
    extra = ["--model.rl.needs_cached_old_logprobs=true"] if how == "flag" else ["--config", str(old)]
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", QUICKSTART, *extra])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err.startswith(f"lightning-grpo: error: {says}") and "drop the key" in err


def test_max_steps_zero_is_refused_before_the_policy_loads(no_policy, tmp_path, monkeypatch):
    """Lightning would set up, train nothing and end without a word."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIGHTNING_GRPO_DEBUG", "1")
    with pytest.raises(ValueError, match=r"trainer.max_steps=0: the fit would train nothing.*set trainer.max_steps > 0"):
        main(["fit", "--config", QUICKSTART, "--trainer.logger=false", "--trainer.max_steps=0"])


USER_FILES = {
    "trl_rewards.py": ("def by_level(prompts, completions, difficulty, **kwargs):\n"
                       "    return [0.0] * len(completions)\n"),
    "shell_env.py": "import os\n\n\nclass ShellEnv:\n    tools = [os.system]\n\n    def reset(self, **row):\n"
                    "        return None\n",
    "vlm.jsonl": "".join(f'{{"prompt": "Which color?", "images": ["{name}.png"], "answer": "red"}}\n'
                         for name in ("red", "red", "missing", "red")),
}
"""A user's files in the working folder: a TRL-style reward, an environment whose tool is os.system, VLM rows."""
VLM = ["--data.source=vlm.jsonl", "--data.val_size=0", "--model.policy.path=tiny:vlm-quickstart"]
# (overrides of the quickstart, fragments of the short report: the cause, the knob and the fix)
SHORT = {
    "endless_cosine": (["--trainer.max_steps=-1", "--model.optim.schedule=cosine"],
                       ["optim.schedule='cosine'", "no countable end", "set optim.total_steps"]),
    "trl_keyword": (["--model.rewards=[{name: trl_rewards:by_level}]"],
                    ["reward 'trl_rewards:by_level' requires ['difficulty']", "Rename the parameter to a column"]),
    "async_colocated": ([SERVER, TIS, "--model.rollout.max_off_policy_steps=1"],
                        ["rollout.max_off_policy_steps=1 with HandoffCallback(placement='colocated'",
                         "set the callback's placement: disaggregated"]),
    "env_tool_os_system": (["--model.env.name=shell_env:ShellEnv"],
                           ["tool 'system' is a function of Python's standard library", "a tool is a method"]),
    "parser_eval": (["--model.env.parser=builtins:eval"],
                    ["model.env.parser='builtins:eval' is a function of Python's standard library"]),
    "server_url": ([SERVER, "--model.rollout.server.url=http://127.0.0.1:9"],
                   ["rollout.server.url=http://127.0.0.1:9: no vLLM server answers there",
                    "set rollout.server.url: null"]),
    "tiny_unknown": (["--model.policy.path=tiny:nonesuch"],
                     ["policy.path='tiny:nonesuch': not a known tiny policy (default, quickstart", "policy.tiny"]),
    "missing_image": (VLM, ["1 of 4 rows name a missing image file (row 2: missing.png)", "data.on_bad_record=skip"]),
}


@pytest.mark.parametrize("case", list(SHORT))
def test_each_refusal_is_short_and_comes_before_the_policy_loads(case, no_policy, tmp_path, monkeypatch, capsys):
    """The report is the cause, the knob and the fix in a few lines (no traceback), before any weight is read."""
    overrides, says = SHORT[case]
    for name, text in USER_FILES.items():
        (tmp_path / name).write_text(text)
    Image.new("RGB", (28, 28), (255, 0, 0)).save(tmp_path / "red.png")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIGHTNING_GRPO_DEBUG", raising=False)
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", QUICKSTART, "--trainer.logger=false", *overrides])
    report = capsys.readouterr().err.strip().splitlines()
    report = report[next(i for i, line in enumerate(report) if line.startswith("lightning-grpo: error:")):]
    assert stop.value.code == 2 and 2 <= len(report) <= 5, "\n".join(report)
    for words in says:
        assert words in "\n".join(report), "\n".join(report)
