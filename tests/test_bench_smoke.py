"""The in-process benches still run (their --quick form), writing to a scratch folder, never to bench/results/.

bench.routing_replay had crashed since the policy build moved into `configure_model`, unnoticed until a rerun: a
performance claim is only as good as the script that reproduces it. Benches that need the TRL venv, vLLM or many
minutes (speed_vs_trl, weight_sync, engine_throughput, lora, oom_acceptance, logprobs, sampler, offload, precision)
are left to `make bench`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
QUICK = {  # name -> extra arguments; each about 10-35 s on 2 cores
    "routing_replay": ["--repeats", "1"],
    "teacher_cost": [],
    "budget_speed": [],
    "lightning_overhead": [],
    "update_memory": [],
    "ahead_pass": [],
    "vlm_memory": [],
    "entropy_cost": [],
    "packing": ["--repeats", "1"],
    "generation": [],
    "tool_calls": [],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(QUICK))
def test_bench_runs_and_writes_its_results(tmp_path, name):
    env = {**os.environ, "LIGHTNING_GRPO_BENCH_RESULTS": str(tmp_path)}
    committed = {p: p.stat().st_mtime_ns for p in (ROOT / "bench" / "results").glob("*")}
    proc = subprocess.run([sys.executable, "-m", f"bench.{name}", "--quick", *QUICK[name]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["command"].startswith(f"python -m bench.{name}") and "--quick" in result["command"]
    assert {p: p.stat().st_mtime_ns for p in committed} == committed  # bench/results/ untouched
