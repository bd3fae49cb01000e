"""The ``vllm serve`` client and its weight sync against a stub server on loopback (tests/rollout/conftest.py).

The contract, not the wording: a sync calls vLLM's phases in order and is checked (the version the server reports,
a probe of its logprobs against the trainer's), and every failure (a sync that did not land, another weight version,
a phase past its timeout, a server that died) raises instead of hanging or sampling with stale weights.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from toy import ToyLM, ids_text, toy_logprobs

from lightning_grpo.rollout.base import Prompt, SamplingConfig
from lightning_grpo.rollout.server.http_json import ServerError
from lightning_grpo.rollout.server.probe import StaleEngineError
from lightning_grpo.rollout.server_config import ServerConfig
from lightning_grpo.rollout.vllm_server import VLLMServerEngine
from lightning_grpo.rollout.weight_sync import push_weights

SYNC = ["/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache", "/weight_info",
        "/v1/completions"]
"""The phases of one sync after the session opens: every bucket, finish, reset, then the checks."""




def connect(stub, folder, trainer: ToyLM | None = None, transport: str = "http", **timeouts) -> VLLMServerEngine:
    config = ServerConfig(url=stub.url, dtype="float32", weight_transport=transport, **timeouts)
    reference = None if trainer is None else functools.partial(toy_logprobs, trainer)
    return VLLMServerEngine(folder, config, reference=reference, decode=ids_text)


@pytest.mark.parametrize("transport", ["http", "shm"])
def test_a_sync_runs_the_phases_in_order_and_the_server_then_holds_the_trainers_weights(
        stub_server, policy_folder, transport):
    trainer = ToyLM(seed=0)
    engine = connect(stub_server, policy_folder, trainer, transport)
    assert stub_server.phases[-1] == "/init_weight_transfer_engine"
    stub_server.phases.clear()
    push_weights(trainer, engine)
    buckets = stub_server.phases.count("/update_weights")
    assert buckets >= 1
    assert stub_server.phases == SYNC[:1] + SYNC[1:2] * buckets + SYNC[2:]
    assert stub_server.version == "1" and engine.version == 1
    assert engine.last_probe_error < 1e-6  # float32 on the wire, float64 on both sides
    for name, value in trainer.state_dict().items():
        torch.testing.assert_close(stub_server.model.state_dict()[name], value, atol=1e-6, rtol=0)
    push_weights(trainer, engine)  # every sync moves the version on by one
    assert stub_server.version == "2" and engine.version == 2


def test_a_sync_that_did_not_land_is_caught_by_the_probe(stub_server, policy_folder):
    engine = connect(stub_server, policy_folder, ToyLM(seed=0))
    stub_server.drop_updates = True
    with pytest.raises(StaleEngineError):
        push_weights(ToyLM(seed=0), engine)


def test_another_weight_version_on_the_server_is_refused(stub_server, policy_folder):
    """The weights landed (the probe agrees), but the server reports a version this run did not publish."""
    trainer = ToyLM(seed=0)
    engine = connect(stub_server, policy_folder, trainer)
    push_weights(trainer, engine)
    stub_server.report_version = "7"
    with pytest.raises(StaleEngineError):
        engine.check_current()
    stub_server.report_version = None
    assert engine.check_current() < 1e-6


def test_without_a_reference_the_version_alone_is_checked(stub_server, policy_folder):
    engine = connect(stub_server, policy_folder)
    stub_server.drop_updates = True
    push_weights(ToyLM(seed=0), engine)  # nothing probes the weights: only the version can tell
    stub_server.report_version = "0"
    with pytest.raises(StaleEngineError):
        engine.check_current()


@pytest.mark.parametrize("route", ["/start_weight_update", "/update_weights", "/finish_weight_update"])
def test_a_phase_past_its_timeout_raises_instead_of_hanging(stub_server, policy_folder, route):
    engine = connect(stub_server, policy_folder, ToyLM(seed=0), sync_timeout_s=0.5)
    stub_server.slow[route] = 3.0
    start = time.monotonic()
    with pytest.raises(ServerError):
        push_weights(ToyLM(seed=0), engine)
    assert time.monotonic() - start < 2.5  # the timeout, not the server's delay


def test_a_generation_past_its_timeout_raises(stub_server, policy_folder):
    engine = connect(stub_server, policy_folder, request_timeout_s=0.5)
    stub_server.slow["/v1/completions"] = 3.0
    with pytest.raises(ServerError):
        engine.generate([Prompt(0, [3, 4, 5])], 1, SamplingConfig(max_new_tokens=2, seed=0))


def test_a_server_that_died_raises_on_the_next_generation_and_sync(stub_server, policy_folder):
    engine = connect(stub_server, policy_folder, ToyLM(seed=0))
    stub_server.die()
    sampling = SamplingConfig(max_new_tokens=2, seed=0)
    with pytest.raises(ServerError):
        engine.generate([Prompt(0, [3, 4, 5])], 2, sampling)
    with pytest.raises(ServerError):
        push_weights(ToyLM(seed=0), engine)


def test_a_url_where_nothing_answers_is_refused_at_connect(stub_server, policy_folder):
    stub_server.die()
    with pytest.raises(ServerError):
        connect(stub_server, policy_folder)


def test_generation_is_token_in_token_out_one_seed_per_row_and_follows_a_sync(stub_server, policy_folder):
    trainer = ToyLM(seed=0)
    engine = connect(stub_server, policy_folder, trainer)
    prompts = [Prompt(0, [3, 4, 5]), Prompt(1, [6, 7])]
    sampling = SamplingConfig(max_new_tokens=4, seed=11, logprobs=True)
    before = engine.generate(prompts, 2, sampling)
    assert [r.prompt.id for r in before] == [0, 0, 1, 1]
    assert all(len(r.token_ids) == 4 and len(r.logprobs) == 4 for r in before)
    assert before[0].token_ids != before[1].token_ids  # each row its own seed
    assert [r.token_ids for r in engine.generate(prompts, 2, sampling)] == [r.token_ids for r in before]
    push_weights(trainer, engine)
    after = engine.generate(prompts, 2, sampling)
    for r in after:  # the sampler's logprobs are now the trainer's, token for token
        trainer_lp = toy_logprobs(trainer, list(r.prompt.token_ids) + r.token_ids)[len(r.prompt.token_ids) - 1:]
        assert max(abs(a - b) for a, b in zip(r.logprobs, trainer_lp)) < 1e-5
