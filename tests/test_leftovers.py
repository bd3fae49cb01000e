"""A fit leaves nothing in ``/dev/shm`` (RAM until reboot), with each engine, after a failure too: no vLLM
``psm_*`` / ``sem.mp-*`` segments of a stopped server, no ``lightning-grpo-*`` adapter or weight-bucket folder; nor
vLLM's IPC sockets and dist-init file in the temporary folder (a launched server keeps them in its own folder).

Each fit is a ``lightning-grpo fit`` process of its own, so what it leaves is what a user's run would leave (the
LoRA folder of an in-process engine nobody closes goes at interpreter exit). Entries another process creates
meanwhile would show too (a killed `vllm serve` of another test leaves its segments on purpose): marked ``alone``,
``make test`` runs them after the parallel tests, by themselves; on a shared machine run them alone too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import QUICKSTART_ARGS

SHM = Path("/dev/shm")
OURS = ("psm_", "sem.mp-", "lightning-grpo-")
"""Entries a run of ours may create: vLLM's multiprocessing queues and semaphores, our adapter and bucket folders."""
CONFIGS = Path(__file__).parents[1] / "configs"
SHORT = ["--trainer.max_steps=1", "--data.val_size=0", "--trainer.logger=false", "--trainer.enable_checkpointing=false"]
LORA = ["--config", str(CONFIGS / "lora-quickstart.yaml"), "--trainer.max_steps=4", "--data.val_size=0",
        "--trainer.logger=false", "--trainer.enable_checkpointing=false"]  # n_mini 4: one loop step
FITS = {
    "hf": ([*QUICKSTART_ARGS, *SHORT], 0),
    # an in-process engine serving each publication from a folder in /dev/shm; the fast tier checks that folder's
    # lifetime (closed, dropped, at exit after a failure too) in tests/rollout/test_adapter_slot_unit.py
    "vllm_lora": pytest.param(LORA, 0, marks=pytest.mark.slow),
    "vllm_lora_failure": pytest.param([*LORA, "--model.rewards=[{name: reward_fns:fails_as_batch}]"], 2,
                                      marks=pytest.mark.slow),
    "vllm_server": pytest.param(["--config", str(CONFIGS / "vllm-server.yaml"), *SHORT,
                                 "--model.rollout.server.kv_cache_memory_bytes=33554432"], 0, marks=pytest.mark.slow),
}


TMP = Path(tempfile.gettempdir())
VLLM_TMP = re.compile(r"vllm_dist_[0-9a-f]{32}|[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}")
"""What a vLLM server leaves in the temporary folder when it exits: its dist-init file, its IPC sockets (a uuid)."""


def _ours() -> set[str]:
    shm = {p.name for p in SHM.iterdir() if p.name.startswith(OURS)}
    return shm | {str(p) for p in TMP.iterdir() if VLLM_TMP.fullmatch(p.name)}


def _held() -> set[str]:
    """Names under /dev/shm that a live process maps or holds open."""
    held = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            held.update(re.findall(r"/dev/shm/([^/\s]+)", (proc / "maps").read_text()))
            targets = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        held.update(t.split("/")[3] for t in targets if t.startswith("/dev/shm/"))
    return held


@pytest.mark.heavy  # a fit per engine: CI and `make test-integration`
@pytest.mark.alone
@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
@pytest.mark.parametrize(("args", "code"), list(FITS.values()), ids=list(FITS))
def test_a_fit_leaves_nothing_in_dev_shm(args, code, tmp_path):
    before = _ours()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    proc = subprocess.run([sys.executable, "-m", "lightning_grpo", "fit", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == code, proc.stderr[-3000:]
    assert _ours() - before - _held() == set()
