"""The in-process benches still run (their --quick form), writing to a scratch folder, never to bench/results/.

bench.routing_replay had crashed since the policy build moved into `configure_model`, unnoticed until a rerun: a
performance claim is only as good as the script that reproduces it. Benches that need the TRL venv, vLLM or many
minutes (speed_vs_trl, weight_sync, engine_throughput, lora, oom_acceptance, logprobs, sampler, offload, precision)
are left to `make bench`. Each bench runs as ``python -m bench.<name>`` in a child of the session's fork server
(``helpers.run_forked``): its own process and exit code, without re-importing torch, Lightning and transformers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import run_forked

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
    code, stdout, stderr = run_forked(f"bench.{name}", ["--quick", *QUICK[name]], ROOT, env)
    assert code == 0, stdout[-2000:] + stderr[-3000:]
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["command"].startswith(f"python -m bench.{name}") and "--quick" in result["command"]
    assert {p: p.stat().st_mtime_ns for p in committed} == committed  # bench/results/ untouched
