"""Every config dataclass refuses bad values the same way: all broken rules at once, in one ConfigError."""

import math

import pytest

from lightning_grpo.checks import ConfigError, raise_problems, retired_key
from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig, VLLMConfig
from lightning_grpo.data.rewards import RewardSpec
from lightning_grpo.dpo import DPOConfig
from lightning_grpo.lora import LoraConfig
from lightning_grpo.objectives.opd import OPDConfig
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.rollout.base import SamplingConfig
from lightning_grpo.tiny.spec import TinyPolicySpec

# (config class, overrides breaking several rules, a fragment naming each broken rule's field=value)
SEVERAL = [
    (GRPOConfig, dict(group_size=1, epsilon=2.0, scale_rewards="median", routing_replay="x"),
     ["group_size=1", "epsilon=2.0", "scale_rewards='median'", "routing_replay='x'"]),
    (OptimConfig, dict(lr=0.0, weight_decay=-1.0, warmup_steps=-1), ["lr=0.0", "weight_decay=-1.0", "warmup_steps=-1"]),
    (RolloutConfig, dict(max_new_tokens=0, temperature=0.0, top_k=-1), ["max_new_tokens=0", "temperature=0.0",
                                                                          "top_k=-1"]),
    (VLLMConfig, dict(gpu_memory_utilization=1.5, tensor_parallel_size=0), ["gpu_memory_utilization=1.5",
                                                                            "tensor_parallel_size=0"]),
    (PolicyConfig, dict(path="", warm_start_steps=-1), ["policy.path=''", "policy.warm_start_steps=-1"]),
    (TinyPolicySpec, dict(hidden_size=0, dropout=1.0, init_std=0.0), ["hidden_size=0", "dropout=1.0", "init_std=0.0"]),
    (LoraConfig, dict(rank=0, alpha=-1, sync="x"), ["rank=0", "alpha=-1", "sync='x'"]),
    (OPDConfig, dict(kl="full", teacher_engine="vllm", beta_opd=-1.0, kl_chunk_mb=0.0),
     ["kl='full' with teacher_engine='vllm'", "beta_opd=-1.0", "kl_chunk_mb=0.0"]),
    (DPOConfig, dict(batch_size=0, beta=0.0, loss_type="hinge"), ["batch_size=0", "beta=0.0", "loss_type='hinge'"]),
    (RewardSpec, dict(name="arith", weight=math.nan, timeout_s=0), ["weight=nan", "timeout_s=0"]),
    (SamplingConfig, dict(max_new_tokens=0, temperature=-1.0, top_p=0.0), ["max_new_tokens=0", "temperature=-1.0",
                                                                             "top_p=0.0"]),
]


@pytest.mark.parametrize("cls,overrides,fragments", SEVERAL, ids=[c.__name__ for c, _, _ in SEVERAL])
def test_several_broken_rules_are_reported_together_in_one_error(cls, overrides, fragments):
    with pytest.raises(ConfigError) as err:
        cls(**overrides)
    message = str(err.value)
    assert message.startswith("invalid ") and f"({len(fragments)} problems):" in message.splitlines()[0]
    assert len(err.value.problems) == len(fragments) and all(f"  - {p}" in message for p in err.value.problems)
    for fragment in fragments:
        assert fragment in message, f"{cls.__name__}: {fragment!r} missing from\n{message}"


@pytest.mark.parametrize("cls", [c for c, _, _ in SEVERAL], ids=[c.__name__ for c, _, _ in SEVERAL])
def test_defaults_are_valid(cls):
    cls()


@pytest.mark.parametrize("overrides,fragment", [
    (dict(num_layers=0), "num_layers=0: must be an integer >= 1"),
    (dict(num_heads=2.5), "num_heads=2.5: must be an integer >= 1"),
    (dict(hidden_size=100, num_heads=3, num_kv_heads=1), "hidden_size=100: must divide by num_heads=3"),
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads=3: must divide num_heads=4"),
    (dict(num_experts=2, experts_per_token=3), "experts_per_token=3: must not exceed num_experts=2"),
    (dict(vocab_size=0), "vocab_size=0: must be a positive integer or null"),
    (dict(dropout=-0.1), r"dropout=-0.1: must be in [0, 1)"),
    (dict(router_jitter=-1.0), "router_jitter=-1.0: must be a finite number >= 0"),
    (dict(init_std=math.inf), "init_std=inf: must be a finite number > 0"),
])
def test_tiny_policy_spec_rules(overrides, fragment):
    with pytest.raises(ConfigError, match="invalid policy.tiny config") as err:
        TinyPolicySpec(**overrides)
    assert fragment in str(err.value)


@pytest.mark.parametrize("overrides,fragment", [
    (dict(max_new_tokens=0), "max_new_tokens=0: must be an integer >= 1"),
    (dict(temperature=math.nan), "temperature=nan: must be a finite number >= 0 (0 = greedy)"),
    (dict(top_p=1.5), "top_p=1.5: must be in (0, 1]"),
    (dict(top_k=-1), "top_k=-1: must be an integer >= 0"),
    (dict(stop=("",)), "stop=('',): must be non-empty strings"),
])
def test_sampling_config_rules(overrides, fragment):
    with pytest.raises(ConfigError, match="invalid sampling config") as err:
        SamplingConfig(**overrides)
    assert fragment in str(err.value)


def test_greedy_sampling_is_valid():
    assert SamplingConfig(temperature=0.0).temperature == 0.0


def test_a_reward_name_problem_is_listed_with_the_field_problems():
    with pytest.raises(ConfigError) as err:
        RewardSpec("no_such_module_xyz:f", weight=math.inf)
    assert "2 problems" in str(err.value) and "weight=inf" in str(err.value) and "cannot import module" in str(err.value)


def test_raise_problems_is_silent_without_problems_and_counts_them():
    raise_problems("x config", [])
    with pytest.raises(ConfigError, match=r"^invalid x config \(1 problem\):\n  - a=1: bad$"):
        raise_problems("x config", ["a=1: bad"])


@pytest.mark.parametrize("text", [
    "unrecognized arguments: --rl.grad_accum=4",
    "Problem with given class_path 'lightning_grpo.GRPOModule':\n Group 'rl' does not accept option 'grad_accum'",
    'Parser key "model.init_args.rl.grad_accum": ...',
])
def test_a_retired_key_in_a_parse_error_is_recognized(text):
    assert retired_key(text).startswith("rl.grad_accum is retired for GRPO")


@pytest.mark.parametrize("text", ["unrecognized arguments: --dpo.grad_accum=4", "--model.ctrl.grad_accum=1",
                                  "Group 'dpo' does not accept option 'grad_accum'"])
def test_other_keys_are_not_mistaken_for_a_retired_one(text):
    assert retired_key(text) is None
