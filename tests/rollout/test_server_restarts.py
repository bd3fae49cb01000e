"""Restarts of a launched server that dies in any phase, and the errors a server failure gives (unit tier).

The launched child is ``stub_vllm_server.py`` (a real process on loopback, killed for real with SIGKILL by its armed
fault), so the engine's whole path runs: the request breaks, the client finds the child dead, the engine relaunches
it on its port, republishes the trainer's weights (the stub's probe and version say whether they landed) and redoes
the interrupted work. No vLLM, no model: a few seconds per test.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_grpo.collect.async_rollouts import AsyncRollouts
from lightning_grpo.rollout.base import Prompt, SamplingConfig
from lightning_grpo.rollout.sampler import row_seeds
from lightning_grpo.rollout.server import process as process_module
from lightning_grpo.rollout.server.http_json import ServerError, ServerTimeout
from lightning_grpo.rollout.server.process import ServerDied, ServerProcess
from lightning_grpo.rollout.server_config import ServerConfig
from lightning_grpo.rollout.vllm_server import VLLMServerEngine
from lightning_grpo.rollout.weight_sync import push_weights

STUB = Path(__file__).with_name("stub_vllm_server.py")
CONFIG = ServerConfig(dtype="float32", startup_timeout_s=30.0, sync_timeout_s=10.0, request_timeout_s=10.0)
PHASES = ["generate", "start_weight_update", "update_weights:2", "finish_weight_update", "reset_prefix_cache",
          "weight_info:2", "probe"]
"""Where a death is met: a draw, each phase of a sync, the version check and the probe after it (the first
``weight_info`` is the engine's start-up)."""


class Faults:
    """The stub's fault flags for the children the engine launches (a restarted child gets the same argv)."""

    def __init__(self, tmp_path: Path, *flags: str) -> None:
        self.journal = tmp_path / "journal"
        self.fired = tmp_path / "fired"
        self.flags = [str(self.fired) if f == "fired" else f for f in flags]

    def argv(self, port: int) -> list[str]:
        return [sys.executable, str(STUB), "--port", str(port), "--journal", str(self.journal), *self.flags]

    def routes(self) -> list[tuple[str, str]]:
        """(child pid, route) of every request the children answered or died on, in order."""
        lines = self.journal.read_text().splitlines() if self.journal.exists() else []
        return [tuple(line.split(" ", 1)) for line in lines]


@pytest.fixture
def launch(tmp_path, monkeypatch):
    """``launch(*flags, restarts=...)``: an engine whose launched server is the stub with these fault flags."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"vocab_size": 64}))
    engines, logs = [], []

    def make(*flags: str, restarts: int = 1, config: ServerConfig = CONFIG, republish: bool = True):
        faults = Faults(tmp_path, *flags)

        class StubProcess(ServerProcess):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                self.argv = faults.argv(self.port)
                logs.append(self.log_dir)

            def start(self, *args, **kwargs):
                logs.append(self.log_dir)  # a dead child's log is kept for its user: this test's go with it
                return super().start(*args, **kwargs)

        monkeypatch.setattr("lightning_grpo.rollout.server.pool.ServerProcess", StubProcess)
        cfg = ServerConfig(**{**config.__dict__, "restarts": restarts})
        engine = VLLMServerEngine(tmp_path / "model", cfg, reference=trainer_logprobs, decode=str)
        engines.append(engine)
        policy = tiny_policy()
        engine.republish = (lambda: push_weights(policy, engine, bucket_bytes=1)) if republish else None
        return engine, policy, faults

    yield make
    for engine in engines:
        engine.close()
    for folder in logs:
        shutil.rmtree(folder, ignore_errors=True)


def trainer_logprobs(ids) -> list[float]:
    return [-1.0] * (len(ids) - 1)  # the stub's probe answers -1.0 once a sync landed, -2.0 from the folder


def tiny_policy() -> nn.Module:
    """Three load groups: a sync of bucket_bytes=1 sends three buckets."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))


def prompts() -> list[Prompt]:
    return [Prompt(id=i, token_ids=[3 + i, 4, 5]) for i in range(3)]


SAMPLING = SamplingConfig(max_new_tokens=4, temperature=1.0, logprobs=True, seed=7)


def draw_and_sync(engine, policy) -> list[list[int]]:
    """One loop step's engine work: a sync of the trainer's weights, then a draw."""
    push_weights(policy, engine, bucket_bytes=1)
    return [r.token_ids for r in engine.generate(prompts(), 2, SAMPLING)]


@pytest.mark.parametrize("phase", PHASES)
def test_a_death_in_any_phase_is_restarted_republished_and_redone(launch, phase):
    """Killed in ``phase``: the engine relaunches the server on its port, republishes the trainer's weights (the stub
    comes back with the folder's: without the republish its version and probe fail the check), redoes the sync from
    its first bucket or the draw with the same seeds, and the loop step gives what an uninterrupted one gives."""
    seeds = row_seeds([p.id for p in prompts()], 2, SAMPLING.seed)
    want = [[(seed + i) % 50 for i in range(SAMPLING.max_new_tokens)] for seed in seeds]  # the stub's tokens
    engine, policy, faults = launch("--die-at", phase, "--once", "fired")
    first = engine.server.proc.pid
    url = engine.url
    got = draw_and_sync(engine, policy)
    assert got == want  # the draw's own seeds, once
    assert engine.server_restarts == 1 and engine.restarts.left == 0
    assert engine.server.proc.pid != first and engine.url == url  # relaunched on its port
    after = [route for pid, route in faults.routes() if pid == str(engine.server.proc.pid)]
    buckets = after[after.index("start_weight_update"):after.index("finish_weight_update")]
    assert buckets == ["start_weight_update"] + ["update_weights"] * 3  # the sync redone from its first bucket
    assert after[-1] == "generate"
    assert engine.check_current() == 0.0  # the restarted server holds the trainer's weights


def test_restarts_0_stops_at_the_death_with_a_short_message(launch):
    """No restart allowed: the death stops the run at once, naming the phase, the exit code, the log and the knob
    (the buckets after the dead one are not pushed into a dead server)."""
    engine, policy, faults = launch("--die-at", "update_weights:1", restarts=0)
    with pytest.raises(ServerDied) as err:
        push_weights(policy, engine, bucket_bytes=1)
    lines = str(err.value).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"vllm serve at {engine.url} exited with code -9 (SIGKILL) during update_weights "
                               "(bucket 1); its log: ")
    assert lines[1].startswith("rollout.server.restarts=0: the run stops at a server's death; set "
                               "rollout.server.restarts: 1")
    assert "did not answer within" not in str(err.value)  # no timeout happened
    assert [route for _, route in faults.routes()][-1] == "update_weights"
    assert any(n.startswith("the last lines of") for n in err.value.__notes__)  # kept for error.log


def test_a_server_that_dies_again_spends_the_budget_then_stops(launch):
    """Dying at every draw: each death takes one restart; once ``restarts`` is spent the run stops, saying so."""
    engine, policy, _ = launch("--die-at", "generate:1", restarts=2)
    push_weights(policy, engine, bucket_bytes=1)
    with pytest.raises(ServerDied, match=r"during generate(.|\n)*rollout\.server\.restarts=2: all 2 restart\(s\) are "
                                         r"spent"):
        engine.generate(prompts(), 2, SAMPLING)
    assert engine.server_restarts == 2


def test_a_restart_that_exits_at_start_up_is_reported(launch):
    """The relaunched child exits while starting: its exit code and log, not a hang."""
    engine, policy, _ = launch("--die-at", "generate:1", "--once", "fired", "--exit-on-restart")
    push_weights(policy, engine, bucket_bytes=1)
    with pytest.raises(ServerError, match=r"vllm serve exited with code 3 while starting(.|\n)*exiting at start-up"):
        engine.generate(prompts(), 2, SAMPLING)
    engine.server.log_path.unlink()  # the dead child's log, kept for its user in a file of its own


def test_a_port_taken_after_the_death_is_named_with_the_fix(launch, monkeypatch):
    # the squatter never answers: the draw times out (1 s here, not 10) before the death is found
    quick = ServerConfig(**{**CONFIG.__dict__, "request_timeout_s": 1.0})
    engine, policy, _ = launch("--die-at", "generate:1", "--once", "fired", config=quick)
    push_weights(policy, engine, bucket_bytes=1)
    port = engine.server.port
    monkeypatch.setattr(process_module, "PORT_RELEASE_S", 1.0)
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the TIME_WAIT the death left
    try:
        engine.server.stop()  # the death, then something else takes the port before the restart
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        engine.server.proc.returncode = -9
        with pytest.raises(ServerError, match=rf"port {port} is taken by another process(.|\n)*ss -ltnp "
                                              r"'sport = :\d+'(.|\n)*--ckpt_path last, or set rollout.server.port"):
            engine.generate(prompts(), 2, SAMPLING)
    finally:
        squatter.close()


def test_a_hung_server_is_a_timeout_naming_the_phase_and_the_knob(launch):
    """Alive but silent: a real timeout, how long and which phase, and that the server still runs (no restart)."""
    config = ServerConfig(**{**CONFIG.__dict__, "request_timeout_s": 1.0})
    engine, policy, _ = launch("--hang-at", "generate", config=config)
    push_weights(policy, engine, bucket_bytes=1)
    with pytest.raises(ServerTimeout) as err:
        engine.generate(prompts(), 2, SAMPLING)
    assert str(err.value).startswith(f"generate: {engine.url}/v1/completions did not answer within 1s "
                                     "(rollout.server.request_timeout_s); vllm serve is still running")
    assert engine.server_restarts == 0


def test_without_republish_no_restart_happens(launch):
    """An engine that cannot push the trainer's weights never restarts: the server would sample the folder's."""
    engine, policy, _ = launch("--die-at", "generate:1", republish=False)
    with pytest.raises(ServerDied, match="built without republish"):
        engine.generate(prompts(), 2, SAMPLING)


def test_async_the_worker_never_restarts_the_training_thread_does(launch):
    """Async rollouts: the batch in flight meets the death on the worker thread, which leaves it; the training thread
    takes the batch, restarts the server with the worker idle, republishes and draws the batch again with the same
    seeds, stamped with the weights it was drawn with."""
    engine, policy, faults = launch("--die-at", "generate:7", "--once", "fired")  # the 2nd draw's first request
    threads = []
    republish = engine.republish
    engine.republish = lambda: (threads.append(threading.current_thread()), republish())
    weights = {"step": 0}
    rollouts = AsyncRollouts(engine, 1, weights_step=lambda: weights["step"])
    try:
        push_weights(policy, rollouts, bucket_bytes=1)

        def job(batch, sampling):
            return engine.generate(batch, 2, sampling), {}

        def upcoming(i):
            return prompts(), SAMPLING

        first, _, _ = rollouts.take(1, prompts(), SAMPLING, job)
        rollouts.submit_ahead(1, upcoming, job)  # step 2 in flight: its draw meets the death on the worker
        rollouts.wait_idle()
        assert engine.server_restarts == 0  # the worker did not restart it
        weights["step"] = 1
        again, _, weights_step = rollouts.take(2, prompts(), SAMPLING, job)
    finally:
        rollouts.close()
    assert [r.token_ids for r in again] == [r.token_ids for r in first]  # the same seeds
    assert engine.server_restarts == 1 and weights_step == 1
    assert threads == [threading.main_thread()]


def test_async_a_server_that_dies_again_spends_the_budget_then_stops(launch):
    """The redrawn batch meets a second death: no restart left, the training thread raises the stop message."""
    engine, policy, _ = launch("--die-at", "generate:1", restarts=1)
    rollouts = AsyncRollouts(engine, 1, weights_step=lambda: 0)
    try:
        push_weights(policy, rollouts, bucket_bytes=1)
        with pytest.raises(ServerDied, match=r"during generate(.|\n)*all 1 restart\(s\) are spent"):
            rollouts.take(1, prompts(), SAMPLING, lambda batch, sampling: (engine.generate(batch, 2, sampling), {}))
    finally:
        rollouts.close()
    assert engine.server_restarts == 1


def test_a_server_failure_ends_in_a_few_lines_on_stderr(launch, capsys):
    """The CLI reports a server death as any runtime error: a few lines naming it; the traceback goes to error.log."""
    from lightning_grpo.cli_errors import config_error
    from lightning_grpo.errors import USER_ERRORS

    engine, policy, _ = launch("--die-at", "generate:1", restarts=0)
    push_weights(policy, engine, bucket_bytes=1)
    with pytest.raises(ServerDied) as err:
        engine.generate(prompts(), 2, SAMPLING)
    assert isinstance(err.value, USER_ERRORS)
    with pytest.raises(SystemExit):
        config_error(err.value)
    lines = capsys.readouterr().err.strip().splitlines()
    assert 2 <= len(lines) <= 5 and "exited with code -9 (SIGKILL) during generate" in lines[0]


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"restarts": -1}, r"restarts=-1: must be an integer >= 0"),
    ({"restarts": 1, "url": "http://127.0.0.1:1"}, r"restarts=1 with url set: only a server this run launched can be "
                                                   r"started again"),
])
def test_restarts_that_cannot_work_are_refused_at_load(kwargs, says):
    with pytest.raises(ValueError, match=says):
        ServerConfig(**kwargs)


def test_restarts_with_several_ranks_are_refused_naming_why_and_async_is_accepted():
    from lightning_grpo.config import GRPOConfig, RolloutConfig
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.run_check import check_run

    rollout = RolloutConfig(engine="vllm_server", max_off_policy_steps=1, server=ServerConfig(restarts=1))
    rl = GRPOConfig(rollout_correction={"mode": "tis"})
    check_run(PolicyConfig(), rl, rollout, dp_size=1)
    with pytest.raises(ValueError, match=r"restarts=1 with 2 trainer ranks: the ranks draw at their own pace"):
        check_run(PolicyConfig(), rl, rollout, dp_size=2)
