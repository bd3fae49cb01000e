import dataclasses
import math

import pytest
import yaml

from lightning_grpo.config import ConfigError, GRPOConfig, OptimConfig, RolloutConfig, VLLMConfig
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.run_check import check_run

# (overrides, a fragment the message must contain). Each row breaks exactly one rule.
BAD_RL = [
    (dict(batch_per_replica=0), "batch_per_replica=0: must be a positive integer"),
    (dict(batch_per_replica=-8), "batch_per_replica=-8"),
    (dict(batch_per_replica=30, group_size=8), "batch_per_replica=30: must be a multiple of group_size=8"),
    (dict(group_size=1, batch_per_replica=4), "group_size=1"),
    (dict(group_size=0), "group_size=0"),
    (dict(mini_batch_per_replica=-1), "mini_batch_per_replica=-1"),
    (dict(mini_batch_per_replica=64), "must not exceed batch_per_replica=32"),
    (dict(mini_batch_per_replica=12), "mini_batch_per_replica=12 must divide batch_per_replica=32"),
    (dict(micro_batch_per_replica=-2), "micro_batch_per_replica=-2"),
    (dict(mini_batch_per_replica=16, micro_batch_per_replica=32), "must not exceed the mini-batch (16)"),
    (dict(mini_batch_per_replica=16, micro_batch_per_replica=6), "micro_batch_per_replica=6 must divide the mini-batch (16)"),
    (dict(micro_batch_per_replica=5), "micro_batch_per_replica=5 must divide the mini-batch (32)"),
    (dict(epsilon=0.0), "epsilon=0.0"),
    (dict(epsilon=1.5), "epsilon=1.5"),
    (dict(epsilon=math.nan), "epsilon=nan"),
    (dict(epsilon_high=-0.1), "epsilon_high=-0.1"),
    (dict(beta=-0.01), "beta=-0.01"),
    (dict(beta=math.inf), "beta=inf"),
    (dict(max_grad_norm=-1.0), "max_grad_norm=-1.0"),
    (dict(logits_keep_mb=-1.0), "logits_keep_mb=-1.0: must be a finite number >= 0"),
    (dict(scale_rewards="median"), "scale_rewards='median'"),
    (dict(grad_accum=4), "Set micro_batch_per_replica"),
    (dict(batch_per_replica=True), "batch_per_replica=True"),
    (dict(max_consecutive_skips=-1), "max_consecutive_skips=-1: must be an integer >= 0"),
    (dict(max_consecutive_skips=2.5), "max_consecutive_skips=2.5"),
    (dict(max_tokens_per_micro=512, micro_batch_per_replica=8), "max_tokens_per_micro=512 with micro_batch_per_repl"),
    (dict(max_tokens_per_micro=-1), "max_tokens_per_micro=-1: must be an integer >= 0"),
    (dict(max_tokens_per_ahead_micro=-5), "max_tokens_per_ahead_micro=-5"),
    (dict(mu_iterations=0), "mu_iterations=0: must be an integer >= 1"),
    (dict(mu_iterations=1.5), "mu_iterations=1.5"),
    (dict(loss_type="bnpo"), "loss_type='bnpo': must be one of 'dapo', 'grpo', 'dr_grpo', 'seq-mean-token-sum'"),
    (dict(ratio_level="seq"), "ratio_level='seq': must be 'token' or 'sequence'"),
    (dict(loss="sapo"), "loss='sapo': must be 'ppo_clip' or 'cispo'"),
    (dict(loss="cispo", ratio_level="sequence"), "ratio_level='sequence' with loss='cispo'"),
    (dict(loss="cispo", epsilon=1.5), "epsilon=1.5: with loss='cispo' must be in (0, 1]"),
    (dict(epsilon=1.0), "epsilon=1.0: must be in (0, 1)"),
]


@pytest.mark.parametrize("overrides,fragment", BAD_RL, ids=[f"{i}-{next(iter(o))}" for i, (o, _) in enumerate(BAD_RL)])
def test_bad_rl_config_is_refused_with_field_value_and_rule(overrides, fragment):
    with pytest.raises(ValueError, match=None) as err:
        GRPOConfig(**overrides)
    assert isinstance(err.value, ConfigError)
    assert fragment in str(err.value)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as err:
        GRPOConfig(epsilon=2.0, beta=-1.0, grad_accum=2)
    msg = str(err.value)
    assert "3 problems" in msg and "epsilon=2.0" in msg and "beta=-1.0" in msg and "grad_accum=2" in msg


def test_the_retired_grad_accum_is_refused_by_name_with_what_replaces_it():
    assert "grad_accum" not in {f.name for f in dataclasses.fields(GRPOConfig)}
    assert not hasattr(GRPOConfig, "clip_high")  # unused; the objective reads epsilon_high itself
    for value in (1, 4):  # even the old default: the knob is gone, not ignored
        with pytest.raises(ConfigError) as err:
            GRPOConfig(grad_accum=value)
        msg = str(err.value)
        assert f"grad_accum={value}: rl.grad_accum is retired for GRPO and was removed" in msg
        assert "n_micro = mini_batch_per_replica / micro_batch_per_replica" in msg and "1 problem" in msg


@pytest.mark.parametrize(
    "batch,mini,micro,n_mini,n_micro",
    [(32, 0, 0, 1, 1), (32, 16, 8, 2, 2), (32, 8, 0, 4, 1), (32, 0, 4, 1, 8), (64, 16, 2, 4, 8)],
)
def test_derived_counts(batch, mini, micro, n_mini, n_micro):
    cfg = GRPOConfig(batch_per_replica=batch, mini_batch_per_replica=mini, micro_batch_per_replica=micro, group_size=2)
    assert (cfg.n_mini, cfg.n_micro) == (n_mini, n_micro)


def test_counts_are_dp_invariant():
    cfg = GRPOConfig(batch_per_replica=32, mini_batch_per_replica=16, micro_batch_per_replica=4, group_size=4)
    for dp in (1, 2, 4):
        r = cfg.rank_sizes(dp)
        assert r.batch // r.mini == cfg.n_mini and r.mini // r.micro == cfg.n_micro


@pytest.mark.parametrize(
    "overrides,dp,fragment",
    [
        (dict(batch_per_replica=24, group_size=8), 2, "3 groups must split evenly over DP size 2"),
        (dict(batch_per_replica=32, group_size=4, mini_batch_per_replica=8, micro_batch_per_replica=1), 2,
         "micro_batch_per_replica=1: must divide by DP size 2"),
        (dict(batch_per_replica=24, group_size=2, mini_batch_per_replica=3), 2, "mini_batch_per_replica=3: must divide by DP size 2"),
    ],
)
def test_per_rank_rules_name_the_dp_size(overrides, dp, fragment):
    cfg = GRPOConfig(**overrides)
    with pytest.raises(ConfigError, match="DP size") as err:
        cfg.rank_sizes(dp)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "cls,overrides,fragment",
    [
        (OptimConfig, dict(lr=0.0), "lr=0.0"),
        (OptimConfig, dict(warmup_steps=-1), "warmup_steps=-1"),
        (OptimConfig, dict(betas=(0.9, 1.0)), "betas="),
        (RolloutConfig, dict(max_new_tokens=0), "max_new_tokens=0"),
        (RolloutConfig, dict(temperature=0.0), "temperature=0.0"),
        (RolloutConfig, dict(top_p=0.0), "top_p=0.0"),
        (RolloutConfig, dict(top_k=-1), "top_k=-1: must be an integer >= 0"),
        (RolloutConfig, dict(engine="replay"), "engine=replay needs a JSONL"),
        (VLLMConfig, dict(logprobs_mode="processed"), "logprobs_mode='processed': must be 'auto'"),
    ],
)
def test_other_sections_validate(cls, overrides, fragment):
    with pytest.raises(ConfigError) as err:
        cls(**overrides)
    assert fragment in str(err.value)


@pytest.mark.parametrize("warp", [dict(temperature=0.7), dict(top_p=0.9), dict(top_k=20)])
def test_raw_vllm_logprobs_as_pi_old_under_a_warped_sampler_are_refused(warp):
    rl = GRPOConfig(rollout_correction={"mode": "bypass"})
    raw = RolloutConfig(engine="vllm", vllm=VLLMConfig(logprobs_mode="raw_logprobs"), **warp)
    with pytest.raises(ConfigError, match="vllm.logprobs_mode='raw_logprobs'.*set vllm.logprobs_mode to 'auto'"):
        check_run(PolicyConfig(), rl, raw)
    for ok_rl, ok_rollout in [
        (rl, RolloutConfig(engine="vllm", vllm=VLLMConfig(logprobs_mode="auto"), **warp)),  # resolves to processed
        (rl, RolloutConfig(engine="vllm", vllm=VLLMConfig(logprobs_mode="raw_logprobs"))),  # T=1, no cut: the same
        (GRPOConfig(), raw),  # sampler logprobs unused
    ]:
        check_run(PolicyConfig(), ok_rl, ok_rollout)
    from lightning_grpo.module import GRPOModule

    with pytest.raises(ConfigError, match="raw_logprobs"):  # at construction, before any model is built
        GRPOModule(rl=rl, rollout=raw)


def test_rl_config_round_trips_through_yaml():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--rl", type=GRPOConfig, default=GRPOConfig())
    cfg = parser.parse_args(["--rl.batch_per_replica=16", "--rl.group_size=4", "--rl.micro_batch_per_replica=4"])
    dumped = parser.dump(cfg)
    again = parser.parse_string(dumped)
    assert parser.instantiate_classes(again).rl == GRPOConfig(batch_per_replica=16, group_size=4,
                                                              micro_batch_per_replica=4)
    assert yaml.safe_load(dumped)["rl"]["micro_batch_per_replica"] == 4


def test_bad_value_is_refused_at_parse_time():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--rl", type=GRPOConfig, default=GRPOConfig())
    with pytest.raises(Exception, match="mini_batch_per_replica=12 must divide"):
        parser.instantiate_classes(parser.parse_args(["--rl.mini_batch_per_replica=12"]))


def test_server_config_round_trips_through_yaml():
    from jsonargparse import ArgumentParser

    from lightning_grpo.config import ServerConfig

    parser = ArgumentParser()
    parser.add_argument("--rollout", type=RolloutConfig, default=RolloutConfig())
    cfg = parser.parse_args(["--rollout.engine=vllm_server", "--rollout.server.url=http://10.0.0.2:8000",
                             "--rollout.server.weight_transport=http", "--rollout.server.threads=1"])
    again = parser.instantiate_classes(parser.parse_string(parser.dump(cfg))).rollout
    assert again.engine == "vllm_server"
    assert again.server == ServerConfig(url="http://10.0.0.2:8000", weight_transport="http", threads=1)


def test_several_servers_round_trip_through_yaml_and_each_replica_gets_its_own_port_and_gpus():
    from jsonargparse import ArgumentParser

    from lightning_grpo.config import ServerConfig

    parser = ArgumentParser()
    parser.add_argument("--rollout", type=RolloutConfig, default=RolloutConfig())
    cfg = parser.parse_args(["--rollout.engine=vllm_server", "--rollout.server.url=[http://a:8000/, http://b:8000]"])
    again = parser.instantiate_classes(parser.parse_string(parser.dump(cfg))).rollout.server
    assert again.url == ["http://a:8000/", "http://b:8000"] and again.urls == ["http://a:8000", "http://b:8000"]
    launch = ServerConfig(replicas=2, port=9000, gpus=["4", "5"])
    assert [(r.port, r.gpus, r.replicas) for r in (launch.replica(0), launch.replica(1))] == [(9000, "4", 1),
                                                                                             (9001, "5", 1)]
    assert ServerConfig(url="http://a:1/").urls == ["http://a:1"] and ServerConfig().urls == []


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"url": "localhost:8000"}, r"url='localhost:8000': must start with http://"),
    ({"launch": False}, r"launch=False with url=None: nothing to connect to; set url or launch: true"),
    ({"port": 70000}, r"port=70000: must be in 1\.\.65535, or null"),
    ({"threads": 0}, r"threads=0: must be an integer >= 1"),
    ({"weight_transport": "nccl"}, r"weight_transport='nccl': must be 'auto', 'shm' or 'http'"),
    ({"sync_timeout_s": 0}, r"sync_timeout_s=0: must be a number of seconds > 0"),
    ({"probe_tolerance": -1.0}, r"probe_tolerance=-1\.0: must be > 0"),
    ({"url": []}, r"url=\[\]: an empty list names no server; give at least one URL, or null"),
    ({"url": ["http://a:1", "b:2"]}, r"url=\['http://a:1', 'b:2'\]: must start with http://"),
    ({"url": ["http://a:1", "http://a:1/"]}, r"url=\['http://a:1', 'http://a:1/'\]: names a server twice"),
    ({"replicas": 0}, r"replicas=0: must be an integer >= 1"),
    ({"nice": 20}, r"nice=20: must be an integer in 0\.\.19"),
    ({"nice": -5}, r"nice=-5: must be an integer in 0\.\.19"),
    ({"replicas": 2, "url": "http://a:1"}, r"replicas=2 with url set: .*list every running server in url instead"),
    ({"replicas": 2, "gpus": ["0"]}, r"gpus=\['0'\]: a list gives one CUDA_VISIBLE_DEVICES string per replica"),
])
def test_server_config_refuses(kwargs, match):
    from lightning_grpo.config import ServerConfig

    with pytest.raises(ValueError, match=match):
        ServerConfig(**kwargs)


def test_unknown_engine_is_refused_at_load():
    with pytest.raises(ValueError, match=r"engine='sglang': must be one of 'hf', 'vllm', 'vllm_server', 'replay'"):
        RolloutConfig(engine="sglang")


@pytest.mark.parametrize("kwargs, match", [
    ({"engine": "vllm_server", "max_off_policy_steps": -1}, r"max_off_policy_steps=-1: must be an integer >= 0"),
    ({"engine": "vllm_server", "max_off_policy_steps": 1.5}, r"max_off_policy_steps=1.5: must be an integer >= 0"),
    ({"engine": "hf", "max_off_policy_steps": 1}, r"engine='hf': async rollouts need the sampler in another process"),
    ({"engine": "vllm", "max_off_policy_steps": 2}, r"set engine: vllm_server, or max_off_policy_steps: 0"),
])
def test_async_rollouts_are_refused_below_zero_and_beside_an_in_process_engine(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutConfig(**kwargs)
