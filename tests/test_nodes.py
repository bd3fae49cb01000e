"""Several nodes, run for real on one host: two torchrun node agents (or two ``srun`` tasks, simulated).

Each node has its own working folder (its local disk) and every node sees one shared folder (the shared
filesystem: logs, checkpoints). The runs go through the CLI (``tests/node_worker.py``: ``lightning-grpo fit`` under
an audit hook that lists what each rank wrote). Loopback only; OMP_NUM_THREADS=1 on every rank, so the one-node
and two-node runs do the same float operations.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from helpers import TINY_JOB

from lightning_grpo.timing import is_timing

TESTS = Path(__file__).parent
WORKER = TESTS / "node_worker.py"
LOOP_STEPS = 6
TIMEOUT = 600


@dataclass
class Job:
    """The folders of one simulated job: a node-local folder per node, one shared folder, logs and audits."""

    root: Path
    nodes: int

    def __post_init__(self) -> None:
        for folder in [self.shared, self.logs, self.audit, *self.node_dirs]:
            folder.mkdir(parents=True, exist_ok=True)

    @property
    def shared(self) -> Path:
        return self.root / "shared"

    @property
    def node_dirs(self) -> list[Path]:
        return [self.root / f"node{n}" for n in range(self.nodes)]

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def audit(self) -> Path:
        return self.root / "audit"

    def env(self) -> dict:
        path = os.pathsep.join([str(TESTS), *sys.path])
        return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "LGRPO_AUDIT_DIR": str(self.audit),
                "WANDB_MODE": "offline"}

    def rows(self, version: int) -> list[dict]:
        """The metrics rows of one launch (the CSV logger's ``version_<n>``), timings dropped."""
        with open(self.shared / "runs" / "tiny" / f"version_{version}" / "metrics.csv") as f:
            return [{k: v for k, v in r.items() if not is_timing(k)} for r in csv.DictReader(f)]

    def checkpoints(self) -> list[Path]:
        return sorted(self.shared.rglob("loop-step-*.ckpt"))

    def written(self, rank: int) -> list[Path]:
        """What global rank ``rank`` opened for writing, created or renamed into, over every launch."""
        lines = (self.audit / f"rank{rank}.txt").read_text().splitlines()
        return [Path(p) for p in lines if not p.startswith("#")]


def write_config(job: Job, policy_dir: Path, nodes: int, devices: int, checkpoints: str | None = None) -> Path:
    """The tiny GRPO job on ``nodes`` x ``devices`` ranks; logs and checkpoints on the shared folder (``checkpoints``:
    another ``checkpoint.dirpath``)."""
    config = {
        "seed_everything": 0,
        "trainer": {"max_steps": LOOP_STEPS * 2, "accelerator": "cpu", "devices": devices, "num_nodes": nodes,
                    "strategy": "ddp", "enable_progress_bar": False, "enable_model_summary": False,
                    "default_root_dir": str(job.shared),  # Lightning's SLURM requeue checkpoint lands here
                    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                               "init_args": {"save_dir": str(job.shared / "runs"), "name": "tiny"}}},
        "checkpoint": {"every_n_loop_steps": 1, "keep_last": 0, "dirpath": checkpoints},
        "model": {"policy": {"path": str(policy_dir)}, **TINY_JOB},
        "data": {"source": "builtin:arith", "val_size": 0},
    }
    path = job.shared / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(job: Job, per_node: int, *args: str) -> list[int]:
    """``torchrun --nnodes=<nodes> --nproc-per-node=<per_node>`` on every node (c10d rendezvous on loopback), each
    agent in its node's folder; waits for all; their exit codes."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={job.nodes}", f"--nproc-per-node={per_node}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=0", str(WORKER),
           "fit", "--config", str(job.shared / "job.yaml"), *args]
    procs = [_start(cmd, node, job, job.env(), f"agent{n}") for n, node in enumerate(job.node_dirs)]
    return _wait(procs, job)


def slurm_job_id() -> str:
    """A job id whose port is free: Lightning's SLURM rendezvous port is 15000 + the id's last 4 digits."""
    for _ in range(100):
        port = 15000 + int.from_bytes(os.urandom(2), "big") % 10000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return f"77{port - 15000:04d}"
    raise RuntimeError("no free port in 15000..24999")


def srun(job: Job, *args: str, job_id: str, scontrol: Path) -> list[subprocess.Popen]:
    """One task per node as ``srun`` starts them (``SLURM_*`` set, no torchrun); ``scontrol`` on PATH. Not waited."""
    ntasks = str(job.nodes)
    slurm = {"SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": "grpo", "SLURM_NNODES": ntasks, "SLURM_NTASKS": ntasks,
             "SLURM_NTASKS_PER_NODE": "1", "SLURM_NODELIST": "127.0.0.1", "SLURM_JOB_NODELIST": "127.0.0.1",
             "SLURM_LOCALID": "0", "PATH": f"{scontrol}{os.pathsep}{os.environ['PATH']}"}
    cmd = [sys.executable, str(WORKER), "fit", "--config", str(job.shared / "job.yaml"), *args]
    procs = []
    for n, node in enumerate(job.node_dirs):
        env = {**job.env(), **slurm, "SLURM_PROCID": str(n), "SLURM_NODEID": str(n)}
        procs.append(_start(cmd, node, job, env, f"task{n}"))
    return procs


def _start(cmd: list[str], cwd: Path, job: Job, env: dict, name: str) -> subprocess.Popen:
    log = open(job.logs / f"{name}.log", "a")  # noqa: SIM115 (closed by the child's exit; the test reads it)
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait(procs: list[subprocess.Popen], job: Job) -> list[int]:
    try:
        return [p.wait(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def tails(job: Job) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(job.logs.glob("*.log")))


def final_weights(job: Job) -> dict:
    last = [p for p in job.checkpoints() if f"loop-step-{LOOP_STEPS:06d}" in p.name]
    assert len(last) == 1, job.checkpoints()
    return torch.load(last[0], weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_policy_dir):
    """The same job on 1 node x 2 ranks and on 2 nodes x 1 rank, each uninterrupted."""
    out = {}
    for name, nodes, per_node in (("one_node", 1, 2), ("two_nodes", 2, 1)):
        job = Job(tmp_path_factory.mktemp(name), nodes)
        write_config(job, tiny_policy_dir, nodes, per_node)
        codes = torchrun(job, per_node)
        assert codes == [0] * nodes, tails(job)
        out[name] = job
    return out


@pytest.mark.slow
def test_two_nodes_equal_one_node_with_two_ranks_bit_for_bit(runs):
    one, two = runs["one_node"], runs["two_nodes"]
    assert two.rows(0) == one.rows(0)  # every metric of every loop step, as logged
    assert [r["step"] for r in two.rows(0)] == [str(s) for s in range(1, LOOP_STEPS + 1)]
    a, b = final_weights(one), final_weights(two)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first = torch.load(min(two.checkpoints()), weights_only=True)["state_dict"]
    assert any(not torch.equal(first[k], b[k]) for k in b)  # the policy moved: the comparison has teeth


@pytest.mark.slow
def test_only_global_rank_0_writes_and_only_to_the_shared_folder(runs):
    job = runs["two_nodes"]
    for node in job.node_dirs:
        assert list(node.iterdir()) == []  # a node's own disk holds nothing a resume could need
    rank0 = job.written(0)
    rank1 = job.written(1)
    assert [p for p in rank1 if job.root in p.parents] == []  # rank 1 writes neither shared nor node-local files
    assert [p for p in rank0 if job.root in p.parents and job.shared not in p.parents] == []
    ckpts = job.checkpoints()
    assert [p.name.split("-")[2] for p in ckpts] == [f"{s:06d}" for s in range(1, LOOP_STEPS + 1)]
    assert set(ckpts) <= set(rank0)  # written once, by global rank 0


@pytest.mark.slow
def test_two_nodes_resume_from_the_shared_checkpoint_exactly(runs, tmp_path, tiny_policy_dir):
    """A new two-node launch from loop step 3's checkpoint (on the shared folder) continues the run row for row."""
    two = runs["two_nodes"]
    saved = next(p for p in two.checkpoints() if "loop-step-000003" in p.name)
    job = Job(tmp_path, nodes=2)
    write_config(job, tiny_policy_dir, nodes=2, devices=1)
    assert torchrun(job, 1, f"--ckpt_path={saved}") == [0, 0], tails(job)
    assert job.rows(0) == two.rows(0)[3:]
    a, b = final_weights(two), final_weights(job)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_checkpoint_folder_only_one_node_sees_is_refused_on_every_rank_at_resume(runs, tmp_path, tiny_policy_dir):
    """``checkpoint.dirpath: ckpt`` (relative: each node's own working folder) holds a checkpoint on node 0 only:
    ``--ckpt_path last`` finds it on one node and nothing on the other. Both ranks stop at setup, naming the knob,
    instead of one resuming while the other starts from scratch (or waits forever)."""
    job = Job(tmp_path, nodes=2)
    write_config(job, tiny_policy_dir, nodes=2, devices=1, checkpoints="ckpt")
    saved = next(p for p in runs["two_nodes"].checkpoints() if "loop-step-000003" in p.name)
    local = job.node_dirs[0] / "ckpt"
    local.mkdir()
    for part in saved.parent.glob(saved.name.replace(".ckpt", ".*")):  # the file, its manifest and config
        (local / part.name).write_bytes(part.read_bytes())
    codes = torchrun(job, 1, "--ckpt_path=last")
    logs = tails(job)
    assert codes != [0, 0] and logs.count("checkpoint.dirpath: rank 0 ") == 2, logs
    assert "a filesystem every node mounts" in logs


@pytest.mark.slow
def test_an_explicit_checkpoint_only_one_node_sees_is_refused_on_every_rank(runs, tmp_path, tiny_policy_dir):
    """``--ckpt_path ckpt/<file>`` (relative: each node's own working folder) exists on node 0 only. Node 1 used to
    stop at parse time ("no such file") while rank 0 waited for it forever; now both ranks reach setup and stop
    together, naming the folder."""
    job = Job(tmp_path, nodes=2)
    write_config(job, tiny_policy_dir, nodes=2, devices=1)
    saved = next(p for p in runs["two_nodes"].checkpoints() if "loop-step-000003" in p.name)
    local = job.node_dirs[0] / "ckpt"
    local.mkdir()
    for part in saved.parent.glob(saved.name.replace(".ckpt", ".*")):  # the file, its manifest and config
        (local / part.name).write_bytes(part.read_bytes())
    codes = torchrun(job, 1, f"--ckpt_path=ckpt/{saved.name}")
    said = [f.read_text() for f in sorted(job.logs.glob("agent*.log"))]  # whole logs: c10d's teardown follows
    assert codes != [0, 0] and len(said) == 2, tails(job)
    for log in said:  # each node's rank stopped with the refusal, none waited forever
        assert "checkpoint.dirpath: rank 0 resumes from ckpt/" in log and "which rank 1 (node 1) cannot see" in log
        assert "a filesystem every node mounts" in log


def fake_scontrol(folder: Path) -> Path:
    """A ``scontrol`` that records its call (with the caller's SLURM_PROCID) in ``folder/scontrol.log``."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$SLURM_PROCID $@" >> {folder / "scontrol.log"}\n')
    script.chmod(0o755)
    return bin_dir


def wait_for(path_glob: str, folder: Path, procs: list[subprocess.Popen], job: Job) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not list(folder.rglob(path_glob)):
        assert all(p.poll() is None for p in procs), tails(job)
        assert time.monotonic() < deadline, tails(job)
        time.sleep(0.1)


@pytest.mark.slow
def test_slurm_sigusr1_requeues_at_the_boundary_and_the_second_launch_resumes_exactly(runs, tmp_path,
                                                                                    tiny_policy_dir):
    """Two ``srun`` tasks (simulated) with Lightning's SLURMEnvironment(auto_requeue=True); SIGUSR1 to both mid-run
    (as ``#SBATCH --signal=USR1@90`` does): the boundary checkpoint lands on the shared folder, rank 0 calls
    ``scontrol requeue <job id>``, both exit 138; the requeued job (the same command) resumes with no loop step lost
    or repeated, and ends where the uninterrupted two-node run ended."""
    job = Job(tmp_path / "job", nodes=2)
    write_config(job, tiny_policy_dir, nodes=2, devices=1)
    scontrol = fake_scontrol(tmp_path)
    job_id = slurm_job_id()
    requeue = "--trainer.plugins=lightning.pytorch.plugins.environments.SLURMEnvironment"
    args = ("--ckpt_path=last", requeue, "--trainer.plugins.auto_requeue=true")
    procs = srun(job, *args, job_id=job_id, scontrol=scontrol)
    wait_for("loop-step-000002-*.ckpt", job.shared, procs, job)
    for p in procs:
        p.send_signal(signal.SIGUSR1)
    assert _wait(procs, job) == [128 + signal.SIGUSR1] * 2, tails(job)
    assert (tmp_path / "scontrol.log").read_text().splitlines() == [f"0 requeue {job_id}"]
    stopped = len(job.checkpoints())
    assert 2 <= stopped < LOOP_STEPS  # the signal stopped the run at a boundary before its end
    hpc = torch.load(job.shared / "hpc_ckpt_1.ckpt", weights_only=True)  # Lightning's own, on the shared folder too
    assert hpc["grpo"]["loop_step"] == stopped
    assert all(list(node.iterdir()) == [] for node in job.node_dirs)

    procs = srun(job, *args, job_id=job_id, scontrol=scontrol)  # SLURM starts the same command again
    assert _wait(procs, job) == [0, 0], tails(job)
    first, second = job.rows(0), job.rows(1)
    assert [r["step"] for r in first + second] == [str(s) for s in range(1, LOOP_STEPS + 1)]
    assert first + second == runs["two_nodes"].rows(0)
    a, b = final_weights(runs["two_nodes"]), final_weights(job)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_vllm_serve_pool_per_node_serves_its_own_nodes_ranks_and_equals_one_shared_pool(tmp_path, tiny_policy_dir):
    """``rollout.server.placement: per_node`` on two torchrun nodes: each node's rank launches its own ``vllm serve``
    (float32), samples only from it and pushes each update to it over shared memory (the hop is on its node); every
    sync is checked on both servers (version and probe). Against one pool shared by 2 ranks on one node: the same
    metrics and weights within the engine's tolerance (the seeds fix every row's tokens, wherever it is sampled)."""
    pytest.importorskip("vllm")
    from test_distributed import launch_two_ranks

    worker = TESTS / "server_dp_worker.py"
    base = [str(worker), "--policy", str(tiny_policy_dir), "--k", "0"]
    one = tmp_path / "one_pool"
    one.mkdir()
    launch_two_ranks(one, tiny_policy_dir, [], timeout=TIMEOUT, cmd=[sys.executable, *base, "--out", str(one)])
    job = Job(tmp_path / "per_node", nodes=2)
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=0", *base, "--out", str(job.shared),
           "--nodes", "2", "--placement", "per_node"]
    procs = [_start(cmd, node, job, job.env(), f"agent{n}") for n, node in enumerate(job.node_dirs)]
    assert _wait(procs, job) == [0, 0], tails(job)
    per_node = [json.loads((job.shared / f"rank{r}.json").read_text()) for r in (0, 1)]
    shared = [json.loads((one / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert per_node[0]["launched"] and per_node[1]["launched"]  # each node's local rank 0 launched its pool
    assert len(per_node[0]["urls"]) == len(per_node[1]["urls"]) == 1 and per_node[0]["urls"] != per_node[1]["urls"]
    assert [list(r["transports"].values()) for r in per_node] == [["shm"], ["shm"]]  # every hop within its node
    assert per_node[0]["rows"] == per_node[1]["rows"] == 2 * 4  # each server sampled its own rank's prompts only
    assert per_node[0]["versions"] == per_node[1]["versions"] == [1, 2]  # each pool synced once per loop step
    assert per_node[0]["probe_error"] < 1e-5 and per_node[1]["probe_error"] < 1e-5  # checked on both servers
    assert per_node[0]["params"] == per_node[1]["params"] and per_node[0]["metrics"] == per_node[1]["metrics"]
    for a, b in zip(per_node[0]["metrics"], shared[0]["metrics"]):
        assert a.keys() == b.keys()
        assert all(a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6, nan_ok=True) for k in a if not is_timing(k))
    assert per_node[0]["params"] == shared[0]["params"]  # measured: the same weights bit for bit (float32 servers)
