"""Data parallel on 2 CPU gloo ranks: a 2-rank loop step equals the 1-rank step on the same collected batch.

``dist_worker.py`` runs the 2-rank side (two processes launched here as torchrun would, each a real
``Trainer.fit``); the 1-rank side runs in this process. Parameter *updates* are compared with plain SGD,
so the update is the gradient. The batch puts long completions on rank 0 and short ones on rank 1, the
case a per-rank token mean gets wrong.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import dist_worker as W
import pytest
import torch
from helpers import max_rel_delta, params_of, synthetic_batch

from lightning_grpo.advantages import dp_batch_std
from lightning_grpo.config import ConfigError, GRPOConfig, RolloutConfig
from lightning_grpo.metrics import roll_up
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.rank_metrics import combine_ranks
from lightning_grpo.timing import is_timing

pytestmark = pytest.mark.heavy  # the shared 2-rank launch (tests/conftest.two_rank_cases): CI and `make test-integration`

TOL = 1e-6
WORKER = Path(__file__).with_name("dist_worker.py")
CASES = ["ddp-m1", "ddp-m4", "ddp-m4-clip", "ddp-m1-rankmean", "ddp-m4-nan", "ddp-m4-steps2",
         "fsdp2-m1", "fsdp2-m4", "fsdp2-m4-clip", "ddp-m1-refuse", "ddp-budget", "fsdp2-budget", "ddp-m4-lora",
         "ddp-budget-packed", "fsdp2-budget-packed", "ddp-budget-early"]


def launch_two_ranks(out: Path, policy: Path, cases: list[str], timeout: float = 300, teacher: Path | None = None,
                     cmd: list[str] | None = None) -> None:
    """Start rank 0 and rank 1 of ``dist_worker.py`` (or ``cmd``) the way torchrun does (env vars), wait for both."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "0", "WORLD_SIZE": "2"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)  # every tests/ folder: a worker names rewards as "test_x:fn"
    if cmd is None:
        cmd = [sys.executable, str(WORKER), "--out", str(out), "--policy", str(policy), "--cases", ",".join(cases)]
        cmd += ["--teacher", str(teacher)] if teacher is not None else []
    logs = [open(out / f"rank{r}.log", "w") for r in (0, 1)]  # noqa: SIM115 (closed below)
    procs = [subprocess.Popen(cmd, env={**env, "LOCAL_RANK": str(r)}, stdout=logs[r], stderr=subprocess.STDOUT)
             for r in (0, 1)]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()
    if codes != [0, 0]:
        tail = "\n".join(f"--- rank {r}\n" + (out / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))
        pytest.fail(f"2-rank worker failed (exit codes {codes}):\n{tail}")


@pytest.fixture(scope="module")
def two_ranks(two_rank_cases):
    """Every case of CASES run on 2 gloo ranks once (tests/conftest.py's one launch); ``load(case, rank)``."""
    return two_rank_cases


_REFERENCE: dict = {}


def one_rank(policy_dir, case: str, steps: int = 1):
    """(params before, params after, LoopResult of the last step): the same loop step(s) in one process."""
    key = (str(policy_dir), case, steps)
    if key not in _REFERENCE:
        module = GRPOModule(policy=W.policy_config(case, str(policy_dir)), rl=W.case_config(case),
                            rollout=RolloutConfig(), seed=W.lora_seed(case))
        module.configure_model()
        before = params_of(module.policy)
        module.updater.attach(torch.optim.SGD(module.policy.parameters(), lr=W.lr_of(case)))
        for _ in range(steps):
            result = module.updater.update(synthetic_batch(W.LENGTHS, seed=W.BATCH_SEED))
        _REFERENCE[key] = before, params_of(module.policy), result
    return _REFERENCE[key]


def test_the_batch_puts_unequal_token_counts_on_the_two_ranks():
    rank0, rank1 = sum(W.LENGTHS[:4]), sum(W.LENGTHS[4:])
    assert rank0 > 5 * rank1  # 65 vs 10 tokens: a per-rank mean weighs rank 1's tokens 6.5x too much


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize("n_micro", [1, 4])
def test_two_ranks_equal_one_rank(two_ranks, tiny_policy_dir, strategy, n_micro):
    case = f"{strategy}-m{n_micro}"
    before, ref, _ = one_rank(tiny_policy_dir, case)
    r0, r1 = two_ranks(case, 0), two_ranks(case, 1)
    assert r0["sharded"] == (strategy == "fsdp2")  # FSDP2 really sharded the policy (DTensor parameters)
    assert max_rel_delta(before, ref, r0["params"]) <= TOL
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in ref)  # the ranks hold one model


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_token_budget_with_uneven_chunk_counts_per_rank_equals_one_rank(two_ranks, tiny_policy_dir, strategy):
    """Rank 0 needs 2 chunks, rank 1 one: rank 1 runs an empty filler, both take 2 backward calls (sync on the last
    only), and the step equals the 1-rank step (which cuts the whole batch into 3 chunks). Finishing is no hang."""
    case = f"{strategy}-budget"
    before, ref, _ = one_rank(tiny_policy_dir, case)
    r0, r1 = two_ranks(case, 0), two_ranks(case, 1)
    assert [len(c) for c in r0["chunks"]] == [2] and r1["chunks"] == (((0, 1, 2, 3), ()),)  # () = the empty filler
    assert max_rel_delta(before, ref, r0["params"]) <= TOL
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in ref)
    t0, t1 = r0["grad_trace"], r1["grad_trace"]
    assert len(t0) == len(t1) == 2
    if strategy == "ddp":  # no_sync on the first call, one all-reduce on the second (rank 1's filler): no double sync
        assert t0[0][1] != t1[0][1] and t0[1][1] == t1[1][1]
    else:
        assert [present for present, _ in t0] == [False, True]
    assert r0["metrics"]["grpo/chunks"] == 3.0 and r0["metrics"]["grpo/empty_chunks"] == 1.0
    assert r0["metrics"]["grpo/n"] == 8.0 and r0["metrics"]["grpo/tokens"] == sum(W.LENGTHS)  # fillers count nothing


def test_a_model_built_before_fit_plans_its_chunks_with_every_rank(two_ranks, tiny_policy_dir):
    """``configure_model()`` called by the user before ``Trainer.fit`` (one process then): the per-rank split and the
    cross-rank max of chunk counts are decided when the optimizer joins, under the strategy. Were either kept from
    before fit, rank 0 would plan 2 chunks and rank 1 one, and the two would hang in their collectives (the
    fixture's launch then times out) or refuse a batch of the one-process size."""
    before, ref, _ = one_rank(tiny_policy_dir, "ddp-budget")
    r0, r1 = two_ranks("ddp-budget-early", 0), two_ranks("ddp-budget-early", 1)
    assert [len(c) for c in r0["chunks"]] == [2] and r1["chunks"] == (((0, 1, 2, 3), ()),)  # agreed: 2 chunks each
    assert max_rel_delta(before, ref, r0["params"]) <= TOL
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in ref)
    assert _untimed(r0["metrics"]) == _untimed(two_ranks("ddp-budget", 0)["metrics"])


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not is_timing(k)}  # wall-clock time differs


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_packed_token_budget_on_two_ranks_equals_one_rank_and_the_padded_step(two_ranks, tiny_policy_dir, strategy):
    """Padding-free packed chunks under data parallelism: each rank packs its own rows (its real-token budget, its own
    chunk count, an empty filler where it has fewer chunks), and the step equals the one-rank packed step and the
    padded one; the ranks hold one model."""
    case = f"{strategy}-budget-packed"
    before, ref, _ = one_rank(tiny_policy_dir, case)
    _, padded, _ = one_rank(tiny_policy_dir, f"{strategy}-budget")
    r0, r1 = two_ranks(case, 0), two_ranks(case, 1)
    assert r0["packed"] and r1["packed"] and not two_ranks(f"{strategy}-budget", 0)["packed"]
    assert max_rel_delta(before, ref, r0["params"]) <= TOL
    assert max_rel_delta(before, padded, r0["params"]) <= TOL
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in ref)
    assert r0["metrics"]["grpo/n"] == 8.0 and r0["metrics"]["grpo/tokens"] == sum(W.LENGTHS)


def test_two_ranks_train_a_lora_adapter_as_one_rank(two_ranks, tiny_policy_dir):
    before, ref, _ = one_rank(tiny_policy_dir, "ddp-m4-lora")
    r0, r1 = two_ranks("ddp-m4-lora", 0), two_ranks("ddp-m4-lora", 1)
    assert max_rel_delta(before, ref, r0["params"]) <= TOL
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in ref)
    moved = {k for k in ref if not torch.equal(before[k], r0["params"][k])}
    assert moved and all(".lora_B." in k for k in moved)  # the frozen base never moves (A: zero gradient at B = 0)


def test_weight_sync_from_fsdp2_shards_sends_the_full_weights(two_ranks):
    for rank in (0, 1):
        r = two_ranks("fsdp2-m4", rank)
        assert r["sync_buckets"] > 1  # 64 KiB buckets: several calls, each with whole tensors
        assert r["pushed"].keys() == r["params"].keys()
        assert all(torch.equal(r["pushed"][k], r["params"][k]) for k in r["params"])


def test_two_loop_steps_equal_one_rank(two_ranks, tiny_policy_dir):
    """The second loop step's first micro-step must not sync either (state left over by DDP's forward)."""
    before, ref, _ = one_rank(tiny_policy_dir, "ddp-m4-steps2", steps=2)
    t0, t1 = two_ranks("ddp-m4-steps2", 0)["grad_trace"], two_ranks("ddp-m4-steps2", 1)["grad_trace"]
    assert max_rel_delta(before, ref, two_ranks("ddp-m4-steps2")["params"]) <= TOL
    assert [a[1] == b[1] for a, b in zip(t0, t1)] == [False, False, False, True] * 2


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_clipping_uses_the_global_gradient_norm(two_ranks, tiny_policy_dir, strategy):
    case = f"{strategy}-m4-clip"
    before, ref, result = one_rank(tiny_policy_dir, case)
    r0 = two_ranks(case)
    norm = result.steps[0].grad_norm
    assert norm > 2 * W.CLIP  # clipping binds, so a per-shard or per-rank norm would scale the step wrongly
    assert r0["metrics"]["grpo/grad_norm"] == pytest.approx(norm, rel=TOL)
    assert max_rel_delta(before, ref, r0["params"]) <= TOL


def test_per_rank_token_mean_fails_the_same_tolerance(two_ranks, tiny_policy_dir):
    """The gate can tell: each rank dividing by its own token count is a different (wrong) update."""
    before, ref, _ = one_rank(tiny_policy_dir, "ddp-m1")
    assert max_rel_delta(before, ref, two_ranks("ddp-m1-rankmean")["params"]) > 0.1


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_non_final_micro_steps_skip_the_gradient_sync(two_ranks, strategy):
    t0, t1 = two_ranks(f"{strategy}-m4", 0)["grad_trace"], two_ranks(f"{strategy}-m4", 1)["grad_trace"]
    assert len(t0) == len(t1) == 4
    if strategy == "ddp":  # no_sync: each rank keeps its own gradient until the last micro-step averages them
        assert all(a[1] != b[1] for a, b in zip(t0[:3], t1[:3]))
        assert t0[3][1] == t1[3][1]
    else:  # set_requires_gradient_sync(False): nothing is reduce-scattered into the sharded grads until the last
        assert [present for present, _ in t0] == [False, False, False, True]


def test_non_finite_chunk_on_one_rank_skips_the_step_on_every_rank(two_ranks, tiny_policy_dir):
    """Rank 0's second chunk is NaN: both ranks abandon the window (no hang), nothing moves."""
    before, _, _ = one_rank(tiny_policy_dir, "ddp-m4")
    for rank in (0, 1):
        r = two_ranks("ddp-m4-nan", rank)
        assert r["metrics"]["grpo/skipped_windows"] == 1.0 and r["metrics"]["grpo/optimizer_steps"] == 0.0
        assert r["metrics"]["grpo/discarded_chunks"] == 3.0  # the NaN chunk + the 2 after it, on both ranks
        assert all(torch.equal(before[k], v) for k, v in r["params"].items())


def test_logged_metrics_are_the_whole_batch_and_agree_across_ranks(two_ranks, tiny_policy_dir):
    _, _, result = one_rank(tiny_policy_dir, "ddp-m4")
    whole = roll_up(result)
    m0, m1 = two_ranks("ddp-m4", 0)["metrics"], two_ranks("ddp-m4", 1)["metrics"]
    assert m0 == m1
    assert m0["grpo/n"] == 8 and m0["grpo/tokens"] == sum(W.LENGTHS)
    assert m0["grpo/denom"] == sum(W.LENGTHS) / 2  # the DP-mean divisor: tokens per rank, averaged
    assert m0["grpo/loss"] == pytest.approx(whole["grpo/loss"], rel=TOL, abs=1e-9)


def test_dp_size_that_does_not_divide_the_mini_batch_is_refused_at_setup(two_ranks):
    for rank in (0, 1):
        msg = two_ranks("ddp-m1-refuse", rank)["error"]
        assert "mini_batch_per_replica=3: must divide by DP size 2" in msg


def test_setup_names_the_dp_size_without_processes(tiny_policy_dir):
    """The same refusal in-process: setup() reads the DP size from the trainer before anything is launched."""
    from lightning.pytorch import Trainer

    module = GRPOModule(policy=PolicyConfig(path=str(tiny_policy_dir)), rl=W.case_config("ddp-m1-refuse"))
    module.trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    with pytest.raises(ConfigError, match="mini_batch_per_replica=3: must divide by DP size 2"):
        module.setup("fit")
    GRPOConfig(batch_per_replica=6, group_size=2, mini_batch_per_replica=3).validate(1)  # fine on one rank


# -- combine_ranks on simulated ranks (threads), no processes --------------------------------------------------------
def simulated_all_reduce(world: int):
    """An ``all_reduce(tensor, op)`` per rank that really reduces across ``world`` threads."""
    barrier, slots = threading.Barrier(world), [None] * world

    def for_rank(rank: int):
        def all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
            slots[rank] = t.clone()
            barrier.wait()
            stacked = torch.stack(slots)
            out = stacked.sum(0) if op == "sum" else stacked.amax(0)
            barrier.wait()
            return out

        return all_reduce

    return for_rank


def run_ranks(per_rank: list[dict], rows: int) -> list[dict]:
    reducer, results = simulated_all_reduce(len(per_rank)), [None] * len(per_rank)

    def work(r):
        results[r] = combine_ranks(per_rank[r], reducer(r), len(per_rank), rows)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(per_rank))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_combine_ranks_gives_the_whole_batch_figures():
    from lightning_grpo.advantages import group_advantages

    rewards = torch.tensor([0.0, 1.0, 3.0, 0.5, 2.0, 2.0, 7.0, 1.0])
    ranks = []
    for r, share in enumerate(rewards.view(2, 4)):
        _, stats = group_advantages(share, group_size=2)
        metrics = {k: float(v) for k, v in stats.items()}
        tokens, clip = (60.0, 0.25) if r == 0 else (20.0, 0.75)
        metrics.update({"grpo/tokens": tokens, "grpo/n": 4.0, "grpo/clip_frac": clip, "grpo/denom": 40.0,
                        "loop_step": 3.0, "grpo/ratio_max": 1.5 + r})
        ranks.append(metrics)
    _, whole = group_advantages(rewards, group_size=2)
    out = run_ranks(ranks, rows=4)
    assert out[0] == out[1]
    c = out[0]
    for name in ("reward/mean", "reward/std", "reward/min", "reward/max", "reward/group_std", "reward/frac_zero_std"):
        assert c[name] == pytest.approx(float(whole[name]), rel=1e-6), name  # float32 inputs
    assert c["grpo/tokens"] == 80.0 and c["grpo/n"] == 8.0
    assert c["grpo/clip_frac"] == pytest.approx((60 * 0.25 + 20 * 0.75) / 80)  # token-weighted, not 0.5
    assert c["grpo/denom"] == 40.0 and c["loop_step"] == 3.0 and c["grpo/ratio_max"] == 2.5


def test_combine_ranks_refuses_ranks_with_different_metric_names():
    reducer, errors = simulated_all_reduce(2), []

    def work(r, metrics):
        try:
            combine_ranks(metrics, reducer(r), 2, 2)
        except RuntimeError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=work, args=(r, m)) for r, m in enumerate([{"a": 1.0}, {"b": 1.0}])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(errors) == 2 and all("different metric names" in e for e in errors)


def test_batch_scaled_advantages_use_the_std_of_every_rank():
    mine, other = torch.tensor([0.0, 1.0, 3.0, 0.5]), torch.tensor([2.0, 2.0, 7.0, 1.0])
    theirs = torch.stack([other.double().sum(), other.double().square().sum(), torch.tensor(4.0, dtype=torch.float64)])
    all_reduce = lambda t, op: t + theirs
    assert float(dp_batch_std(mine, all_reduce)) == pytest.approx(float(torch.cat([mine, other]).std()), rel=1e-6)


def same_metrics(a: dict, b: dict) -> bool:
    """Equal names and values, NaN equal to NaN (completion/terminated_len_mean when no completion terminated)."""
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


# -- real loop steps on 2 ranks (generation included) ----------------------------------------------------------------
@pytest.mark.slow
def test_fsdp2_runs_whole_loop_steps_with_per_rank_rollouts(tmp_path, tiny_policy_dir):
    """Prompts -> HF generation on the sharded policy -> update -> combined metrics, twice, on FSDP2."""
    launch_two_ranks(tmp_path, tiny_policy_dir, ["fsdp2-fit"])
    r0, r1 = (torch.load(tmp_path / f"fsdp2-fit.rank{r}.pt", weights_only=False) for r in (0, 1))
    assert same_metrics(r0["metrics"], r1["metrics"])
    assert r0["metrics"]["loop_step"] == 2.0 and r0["metrics"]["grpo/n"] == 8.0
    assert r0["metrics"]["grpo/grad_norm"] > 0  # the length reward varies: a real gradient flowed
    assert r0["sampling_seed"] != r1["sampling_seed"]  # each rank draws its own stream


@pytest.mark.slow
def test_cli_fit_on_two_ddp_ranks(tmp_path, tiny_policy_dir):
    """``lightning-grpo fit --trainer.devices=2 --trainer.strategy=ddp``: Lightning launches rank 1 itself."""
    import csv

    cmd = [str(Path(sys.executable).with_name("lightning-grpo")), "fit",
           "--trainer.devices=2", "--trainer.accelerator=cpu", "--trainer.strategy=ddp", "--trainer.max_steps=3",
           "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
           f"--model.policy.path={tiny_policy_dir}", "--model.rl.batch_per_replica=8", "--model.rl.group_size=2",
           "--model.rl.micro_batch_per_replica=4", "--model.rollout.max_new_tokens=8", "--model.optim.lr=0.001",
           '--model.rewards=[{name: arith}, {name: "reward_fns:length_reward", weight: 0.1}]',
           "--data.source=builtin:arith", "--data.val_size=0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("lightning-grpo run summary") == 1  # rank 0 only
    [metrics_csv] = (tmp_path / "runs").rglob("metrics.csv")
    rows = [r for r in csv.DictReader(metrics_csv.open()) if r.get("grpo/n")]
    assert [float(r["loop_step"]) for r in rows] == [1.0, 2.0, 3.0]
    assert all(float(r["grpo/n"]) == 8.0 for r in rows)  # both ranks' 4 trajectories, combined
    assert all(float(r["grpo/denom"]) * 2 == float(r["grpo/tokens"]) for r in rows)
    assert list((tmp_path / "runs").rglob("*.ckpt")) and list((tmp_path / "runs").rglob("config.yaml"))


@pytest.mark.slow
@pytest.mark.vllm
def test_each_ddp_rank_generates_with_its_own_vllm_engine_and_syncs_it(tmp_path, tiny_policy_dir):
    """The colocated layout of a multi-GPU node on 2 gloo ranks: one in-process vLLM CPU engine per rank
    (``distributed_executor_backend="external_launcher"``), weights published to both after every update."""
    pytest.importorskip("vllm")
    launch_two_ranks(tmp_path, tiny_policy_dir, ["ddp-vllm-fit"], timeout=900)
    r0, r1 = (torch.load(tmp_path / f"ddp-vllm-fit.rank{r}.pt", weights_only=False) for r in (0, 1))
    n_params = len(r0["params"])
    for r in (r0, r1):
        assert r["engine"] == "VLLMEngine" and r["events"].count("weight_sync") == 3  # one publication per loop step
        assert r["sync"]["n_tensors"] == n_params and r["sync"]["n_buckets"] > 1
        assert len(r["pairs"]) == 3
        for engine_lp, policy_lp in r["pairs"]:  # every draw: this rank's engine holds the trainer's policy
            torch.testing.assert_close(engine_lp, policy_lp, atol=1e-4, rtol=0)
        assert (r["pairs"][-1][0] - r["pairs"][0][0]).abs().max() > 1e-3  # the policy moved and the engine followed
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])  # DDP: one model
    assert same_metrics(r0["metrics"], r1["metrics"]) and r0["metrics"]["grpo/n"] == 8.0  # both ranks' trajectories combined
    assert r0["sampling_seed"] != r1["sampling_seed"]  # each rank's engine draws its own stream
