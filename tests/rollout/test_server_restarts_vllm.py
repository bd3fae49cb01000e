"""A real ``vllm serve`` killed with -9 mid-run: during a draw, during a weight push, during the probe. With
``rollout.server.restarts: 1`` the fit completes and trains on what an uninterrupted fit trains on (synchronous: the
same prompts and tokens; async one step off: the same prompts, the redrawn batch sampled by newer weights); without
restarts it stops with the short message (tests/rollout/test_server_restarts.py has the unit tier of each phase).

One launched server is shared by every fit (its restart budget is reset per fit; a restart relaunches it on its port).
Run alone, under the heavy-job lock: ``flock /tmp/lgrpo-heavy.lock pytest -m slow tests/rollout/test_server_restarts_vllm.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

import pytest
from helpers import TINY_JOB, fit_tiny, global_determinism_restored
from lightning.pytorch import Callback

pytest.importorskip("vllm")

from lightning_grpo.collect.async_rollouts import AsyncRollouts
from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig
from lightning_grpo.correction import RolloutCorrection
from lightning_grpo.data.rewards import RewardSpec
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.rollout.server.process import ServerDied
from lightning_grpo.rollout.server.restarts import ServerRestarts
from lightning_grpo.rollout.server_config import ServerConfig
from lightning_grpo.rollout.vllm_server import VLLMServerEngine, sequence_logprobs
from lightning_grpo.rollout.weight_sync import push_weights

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CONFIG = ServerConfig(dtype="float32", max_model_len=256, enforce_eager=True, threads=1, kv_cache_memory_bytes=32 << 20)
STEPS = 4
BUCKET_MB = 0.05
"""Small buckets: a sync of the tiny policy sends several, so a kill can land between two."""


@pytest.fixture(autouse=True)
def _restore_switches():
    with global_determinism_restored():
        yield


@pytest.fixture(scope="module")
def engine(tiny_policy_dir):
    engine = VLLMServerEngine(tiny_policy_dir, CONFIG)
    yield engine
    engine.close()


class Trained(Callback):
    """Every trained row's (loop step, prompt id, sample, tokens), per loop step."""

    def __init__(self) -> None:
        self.rows: list[list] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rows, g = pl_module.last_rows, pl_module.rl.group_size
        self.rows += [[rows.step, r.prompt.id, i % g, r.token_ids] for i, r in enumerate(rows.rollouts)]


def module_on(engine: VLLMServerEngine, policy_dir, k: int) -> GRPOModule:
    """``TINY_JOB`` drawn by the shared server (``k`` loop steps ahead), whose restarts republish this policy."""
    rollout = RolloutConfig(engine="vllm_server", max_new_tokens=4, max_off_policy_steps=k, sync_bucket_mb=BUCKET_MB,
                            server=dataclasses.replace(CONFIG, restarts=1))
    rl = GRPOConfig(**TINY_JOB["rl"], rollout_correction=RolloutCorrection(mode="tis" if k else "off"))
    module = GRPOModule(policy=PolicyConfig(path=str(policy_dir)), rl=rl, optim=OptimConfig(**TINY_JOB["optim"]),
                        rollout=rollout, rewards=[RewardSpec(**r) for r in TINY_JOB["rewards"]], seed=0)

    def build(will_sleep: bool = True):
        engine.reference = lambda ids: sequence_logprobs(module.policy, ids)
        engine.republish = lambda: push_weights(module.policy, engine, bucket_bytes=int(BUCKET_MB * (1 << 20)))
        if not k:
            return engine
        return AsyncRollouts(engine, k, weights_step=lambda: module.loop_step)

    module.build_engine = build
    return module


def kill(engine: VLLMServerEngine) -> None:
    os.killpg(engine.server.proc.pid, signal.SIGKILL)
    engine.server.proc.wait(timeout=30)


class KillAt:
    """Kills the server the ``n``-th time ``engine.<method>`` (or its first client's) is called, then lets the call
    meet the dead server."""

    def __init__(self, engine: VLLMServerEngine, where: str, n: int) -> None:
        owner = engine.clients[0] if where == "probe" else engine
        self.calls = 0
        original = getattr(owner, where)

        def wrapped(*args, **kwargs):
            self.calls += 1
            if self.calls == n:
                kill(engine)
            return original(*args, **kwargs)

        setattr(owner, where, wrapped)
        self.undo = lambda: owner.__dict__.pop(where)


KILLS = {"draw": ("generate", 3), "push": ("load_weights", None), "probe": ("probe", 3)}
"""Where loop step 3 meets the death: its draw, the second bucket of the sync before it, the probe after it."""


def fit(engine, policy_dir, root: Path, k: int, kill_at: str | None = None) -> tuple[list[list], Trained]:
    module = module_on(engine, policy_dir, k)
    trained = Trained()
    killer = None
    if kill_at is not None:
        where, n = KILLS[kill_at]
        buckets = buckets_per_sync(module) if n is None else 0
        killer = KillAt(engine, where, n or 2 * buckets + 2)  # syncs 1 and 2 whole, then bucket 2 of sync 3
    engine.restarts = ServerRestarts(1)
    try:
        fit_tiny(module, root, loop_steps=STEPS, callbacks=[trained])
    finally:
        if killer is not None:
            killer.undo()
    return trained.rows, module


def buckets_per_sync(module: GRPOModule) -> int:
    from lightning_grpo.policy import load_policy
    from lightning_grpo.rollout.weight_sync import iter_buckets, named_weights

    policy, _ = load_policy(module.policy_cfg)
    return sum(1 for _ in iter_buckets(named_weights(policy), int(BUCKET_MB * (1 << 20))))


@pytest.fixture(scope="module")
def whole(engine, tiny_policy_dir, tmp_path_factory):
    """Uninterrupted fits, synchronous and one step off: their trained rows."""
    out = {}
    for k in (0, 1):
        with global_determinism_restored():
            out[k] = fit(engine, tiny_policy_dir, tmp_path_factory.mktemp(f"whole{k}"), k)[0]
    return out


@pytest.mark.parametrize("k", [0, 1], ids=["sync", "async"])
@pytest.mark.parametrize("kill_at", list(KILLS))
def test_a_server_killed_mid_run_is_restarted_and_the_run_trains_on_the_same_prompts(engine, whole, tiny_policy_dir,
                                                                                     tmp_path, kill_at, k):
    rows, module = fit(engine, tiny_policy_dir, tmp_path, k, kill_at)
    launch_s, republish_s = engine.restarts.seconds[0]
    print(f"\nkilled at {kill_at} (k={k}): restart {launch_s + republish_s:.1f}s "
          f"(launch {launch_s:.1f}s + republish {republish_s:.1f}s)")
    assert engine.server_restarts == 1
    assert module.last_metrics["rollout/server_restarts"] == 1.0
    if k == 0:
        assert rows == whole[0]  # the same prompts, seeds and weights: the same tokens
    else:
        assert [r[:3] for r in rows] == [r[:3] for r in whole[1]]


def test_without_restarts_the_death_stops_the_run_with_the_short_message(engine, tiny_policy_dir, tmp_path):
    """Last: it leaves the shared server dead."""
    module = module_on(engine, tiny_policy_dir, 0)
    killer = KillAt(engine, "generate", 2)
    engine.restarts = ServerRestarts(0)
    with pytest.raises(ServerDied) as err:
        fit_tiny(module, tmp_path, loop_steps=STEPS)
    killer.undo()
    first, second = str(err.value).splitlines()
    assert "exited with code -9 (SIGKILL) during generate; its log: " in first
    assert second.startswith("rollout.server.restarts=0")
    assert "did not answer within" not in str(err.value)
    print("\n" + json.dumps(str(err.value)))
