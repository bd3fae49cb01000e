"""``rollout.server.inflight_updates: false`` (the default) changes nothing: one-step-off async rollouts over the stub
server send the requests and draw the tokens that the tree before in-flight updates did (e8fbd7f), bit for bit.

The golden digest below was recorded by running this file against that tree's package
(``PYTHONPATH=<tree at e8fbd7f> pytest tests/rollout/test_inflight_off.py``, this checkout's tests): every request
body the stub received, in order, every token, sampler logprob (to 10 significant digits: the last bits of a float64
logprob differ between CPUs, e.g. AMD EPYC and Intel Xeon) and the loop step of the weights that
drew each batch. A change to the default path changes the digest.
"""

from __future__ import annotations

import functools
import hashlib
import json

from toy import ToyLM, ids_text, toy_logprobs

from lightning_grpo.collect.async_rollouts import AsyncRollouts
from lightning_grpo.rollout.base import Prompt, SamplingConfig
from lightning_grpo.rollout.server_config import ServerConfig
from lightning_grpo.rollout.vllm_server import VLLMServerEngine
from lightning_grpo.rollout.weight_sync import push_weights

GOLDEN = "a57b323830624e607994cec75fe144fcbce2120d9d98bcaba6efb857a0a4ce64"


def batch(step: int):
    return [Prompt(2 * step, [3, step + 4]), Prompt(2 * step + 1, [step + 5])], \
        SamplingConfig(max_new_tokens=6, seed=step, logprobs=True)


def test_the_default_path_is_the_one_before_inflight_updates_bit_for_bit(stub_server, policy_folder):
    assert digest_of_a_run(stub_server, policy_folder) == GOLDEN


def test_the_digest_sees_the_in_flight_path(stub_server, policy_folder):
    """The control: the same run with the knob on (streamed requests, a pause at each sync) has another digest."""
    assert digest_of_a_run(stub_server, policy_folder, inflight_updates=True) != GOLDEN


def digest_of_a_run(stub_server, policy_folder, **knob) -> str:
    """sha256 of a 3-step one-step-off run: what each batch drew, the routes in order, the request bodies."""
    import torch

    trainer = ToyLM(seed=0)
    config = ServerConfig(url=stub_server.url, dtype="float32", weight_transport="http", **knob)
    engine = VLLMServerEngine(policy_folder, config, reference=functools.partial(toy_logprobs, trainer),
                              decode=ids_text)
    steps = [0]
    rollouts = AsyncRollouts(engine, 1, weights_step=lambda: steps[0])

    def job(prompts, sampling):
        return engine.generate(prompts, 2, sampling), {}

    record = []
    for loop_step in range(3):
        got, _, first = rollouts.take(loop_step + 1, *batch(loop_step + 1), job)
        rollouts.submit_ahead(loop_step + 1, lambda i, s=loop_step + 1: batch(s + i), job)
        record.append([first, [[r.token_ids, [f"{x:.10g}" for x in r.logprobs], r.text, r.finish_reason] for r in got]])
        with torch.no_grad():
            trainer.head.weight.mul_(0.5)
        steps[0] = loop_step + 1
        push_weights(trainer, rollouts)
    rollouts.close()
    routes = [path for path, _ in stub_server.bodies]  # in order: the sync waits for the draw in flight
    bodies = sorted(json.dumps([path, body if path != "/update_weights" else "bucket"], sort_keys=True)
                    for path, body in stub_server.bodies)  # concurrent requests arrive in any order
    return hashlib.sha256(json.dumps([record, routes, bodies], sort_keys=True).encode()).hexdigest()
