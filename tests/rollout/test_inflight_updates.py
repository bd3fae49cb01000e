"""In-flight weight updates (``rollout.server.inflight_updates``) against the stub server (tests/rollout/conftest.py):
a sync lands while completions are being sampled, cuts them, and each continues under the new weights.

The invariant: every token records the weight version that sampled it, and its sampler logprob is that version's
(recomputed under it, each token matches; attributed to the final version, they do not). Refused at load: the knob
with an in-process engine, with synchronous rollouts, with restarts, and a server that cannot pause.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from toy import ToyLM, ids_text, toy_logprobs

from lightning_grpo.checks import ConfigError
from lightning_grpo.collect.async_rollouts import AsyncRollouts
from lightning_grpo.rollout.base import Prompt, SamplingConfig
from lightning_grpo.rollout.rollout_config import RolloutConfig
from lightning_grpo.rollout.server.http_json import ServerError
from lightning_grpo.rollout.server.probe import StaleEngineError
from lightning_grpo.rollout.server_config import ServerConfig
from lightning_grpo.rollout.vllm_server import VLLMServerEngine
from lightning_grpo.rollout.weight_sync import push_weights

PROMPTS = [Prompt(0, [3, 4, 5]), Prompt(1, [6, 7])]
SAMPLING = SamplingConfig(max_new_tokens=24, seed=11, logprobs=True)




def connect(stub, folder, trainer: ToyLM, inflight: bool = True) -> VLLMServerEngine:
    config = ServerConfig(url=stub.url, dtype="float32", weight_transport="http", inflight_updates=inflight)
    return VLLMServerEngine(folder, config, reference=functools.partial(toy_logprobs, trainer), decode=ids_text)


def as_pushed(model: ToyLM) -> ToyLM:
    """The weights a float32 server holds after a sync of ``model``: each rounded to float32."""
    out = ToyLM(seed=0)
    out.load_state_dict({k: v.float().double() for k, v in model.state_dict().items()})
    return out


def token_errors(rollouts, weights: dict[int, ToyLM], versions_of) -> list[float]:
    """|recorded sampler logprob - the logprob under the weights ``versions_of(rollout)`` names|, every token."""
    errors = []
    for r in rollouts:
        ids = list(r.prompt.token_ids) + r.token_ids
        start = len(r.prompt.token_ids) - 1
        for i, (version, recorded) in enumerate(zip(versions_of(r), r.logprobs)):
            recomputed = toy_logprobs(weights[version], ids[: start + i + 2])[start + i]
            errors.append(abs(recomputed - recorded))
    return errors


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the stub server sampled nothing"
        time.sleep(0.005)


def sync_mid_draw(stub, engine, trainer):
    """Draw PROMPTS (2 rows each) while a sync lands once each row sampled 3 tokens; the rollouts."""
    stub.stall_after = 3
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(engine.generate, PROMPTS, 2, SAMPLING)
        while stub.tokens_sampled < 12 and not future.done():
            time.sleep(0.005)
        push_weights(trainer, engine)
        return future.result()


def test_each_token_records_the_version_that_sampled_it_and_its_logprob_is_that_versions(stub_server,
                                                                                          policy_folder):
    trainer = ToyLM(seed=0)
    engine = connect(stub_server, policy_folder, trainer)
    before = ToyLM(seed=1)  # the stub's weights at version 0
    rollouts = sync_mid_draw(stub_server, engine, trainer)
    assert "/pause" in stub_server.phases and "/resume" in stub_server.phases
    assert all(len(r.token_ids) == SAMPLING.max_new_tokens == len(r.versions) for r in rollouts)
    assert all(r.versions == sorted(r.versions) and set(r.versions) <= {0, 1} for r in rollouts)
    assert [r.versions.count(0) for r in rollouts] == [3] * 4  # every row was cut after 3 tokens by the sync
    assert stub_server.phases.count("/v1/completions") == 4 + 1 + 4  # the rows, the probe, a continuation each
    weights = {0: before, 1: as_pushed(trainer)}
    assert max(token_errors(rollouts, weights, lambda r: r.versions)) < 1e-9
    # negative control: every token put on the final version misses the tokens sampled before the sync
    assert max(token_errors(rollouts, weights, lambda r: [1] * len(r.versions))) > 1e-2


def test_without_a_sync_in_flight_the_tokens_are_the_plain_paths(stub_server, policy_folder):
    """Streaming under the gate draws exactly what one request per row draws: same seeds, same tokens, same logprobs."""
    trainer = ToyLM(seed=0)
    plain = connect(stub_server, policy_folder, trainer, inflight=False).generate(PROMPTS, 2, SAMPLING)
    streamed = connect(stub_server, policy_folder, trainer).generate(PROMPTS, 2, SAMPLING)
    assert [r.token_ids for r in streamed] == [r.token_ids for r in plain]
    assert [r.logprobs for r in streamed] == [r.logprobs for r in plain]
    assert all(r.versions == [0] * len(r.token_ids) for r in streamed) and all(r.versions is None for r in plain)


def test_a_sync_with_nothing_in_flight_keeps_the_plain_phases_plus_pause_and_resume(stub_server, policy_folder):
    trainer = ToyLM(seed=0)
    engine = connect(stub_server, policy_folder, trainer)
    stub_server.phases.clear()
    push_weights(trainer, engine)
    assert stub_server.phases[:2] == ["/pause", "/start_weight_update"]
    assert stub_server.phases.index("/resume") < stub_server.phases.index("/weight_info")  # the probe samples
    assert engine.version == 1 and engine.last_probe_error < 1e-6
    after = engine.generate(PROMPTS, 1, SAMPLING)
    assert all(r.versions == [1] * len(r.token_ids) for r in after)


def test_a_server_that_cannot_pause_is_refused_naming_the_knob(stub_server, policy_folder, monkeypatch):
    answer = stub_server.answer
    monkeypatch.setattr(stub_server, "answer", lambda path, body: (404, {}) if path == "/is_paused" else
                        answer(path, body))
    with pytest.raises(ServerError, match="inflight_updates=True.*cannot pause.*inflight_updates: false"):
        connect(stub_server, policy_folder, ToyLM(seed=0))


@pytest.mark.parametrize("engine", ["hf", "vllm", "replay"])
def test_inflight_updates_with_an_engine_in_this_process_is_refused_at_load(engine):
    with pytest.raises(ConfigError, match=f"server.inflight_updates=True with engine='{engine}'.*set engine: "
                                          "vllm_server"):
        RolloutConfig(engine=engine, replay_path="x.jsonl", server=ServerConfig(inflight_updates=True))


def test_inflight_updates_without_async_rollouts_or_with_restarts_is_refused():
    with pytest.raises(ConfigError, match="inflight_updates=True with max_off_policy_steps=0"):
        RolloutConfig(engine="vllm_server", server=ServerConfig(inflight_updates=True))
    with pytest.raises(ConfigError, match="inflight_updates=True with restarts=1"):
        ServerConfig(inflight_updates=True, restarts=1)


def test_one_step_off_with_inflight_updates_bounds_the_first_token_and_scores_every_token_by_its_version(
        stub_server, policy_folder):
    """The async schedule (k = 1) over 4 loop steps, a sync at each boundary landing in the batch in flight: a
    group's first token is at most k steps stale, its later tokens may be newer, each token's logprob is the one of
    the loop step's weights it records; a sync puts the next batch in flight at once (beside the cut one)."""
    stub_server.token_delay = 0.02
    trainer = ToyLM(seed=0)
    engine = connect(stub_server, policy_folder, trainer)
    steps = [0]  # the loop step whose weights the trainer holds
    rollouts = AsyncRollouts(engine, 1, weights_step=lambda: steps[0])
    weights = {0: ToyLM(seed=1)}  # loop step -> the weights the stub held

    def batch(step: int):
        return [Prompt(2 * step, [3, step + 4]), Prompt(2 * step + 1, [step + 5])], \
            SamplingConfig(max_new_tokens=16, seed=step, logprobs=True)

    def job(prompts, sampling):
        return engine.generate(prompts, 2, sampling), {}

    drawn, in_flight = [], []
    for loop_step in range(4):
        got, _, first = rollouts.take(loop_step + 1, *batch(loop_step + 1), job)
        if loop_step == 0:  # the next batch stalls at its 3rd token until the first sync's pause cuts it
            stub_server.stall_after = 2
            sampled = stub_server.tokens_sampled
        rollouts.submit_ahead(loop_step + 1, lambda i, s=loop_step + 1: batch(s + i), job)
        if loop_step == 0:  # ... once it is sampling: the sync lands mid-completion, not before its requests
            wait_until(lambda: stub_server.tokens_sampled > sampled)
        assert loop_step - first <= 1  # put in flight with weights at most k = 1 step old ...
        assert all(first <= r.versions[0] and loop_step - r.versions[0] <= 1 for r in got)  # ... or sent after a sync
        assert all(r.versions[0] <= v <= loop_step for r in got for v in r.versions)
        drawn += got
        with torch.no_grad():  # the update
            trainer.head.weight.add_(0.5 * torch.randn(trainer.head.weight.shape, dtype=torch.float64))
        steps[0] = loop_step + 1
        push_weights(trainer, rollouts)
        weights[loop_step + 1] = as_pushed(trainer)
        in_flight.append(sorted(rollouts.in_flight()))
    assert in_flight[0] == [2, 3]  # the batch the sync cut, and the next one, put in flight by the sync
    assert any(len(set(r.versions)) > 1 for r in drawn)  # some syncs landed mid-completion
    assert max(token_errors(drawn, weights, lambda r: r.versions)) < 1e-9
    assert max(token_errors(drawn, weights, lambda r: [max(r.versions)] * len(r.versions))) > 1e-2
    rollouts.close()


def test_a_sync_that_fails_stops_the_cut_requests_with_its_error(stub_server, policy_folder):
    """A sync that did not land (the probe disagrees): the rows it cut raise the sync's error, never continue."""
    trainer = ToyLM(seed=0)
    engine = connect(stub_server, policy_folder, trainer)
    stub_server.drop_updates = True
    with pytest.raises(StaleEngineError):
        sync_mid_draw(stub_server, engine, trainer)
    assert stub_server.phases.count("/v1/completions") == 4 + 1  # the rows and the probe; no continuation
