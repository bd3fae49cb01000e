"""Run the whole benchmark suite, then regenerate ``docs/benchmarks.md`` from the JSON results.

    make bench                                   # = .venv/bin/python -m bench.run_all
    .venv/bin/python -m bench.run_all --only speed_vs_trl,engine_throughput
    .venv/bin/python -m bench.run_all --doc-only   # re-render the doc from bench/results/*.json

Each benchmark runs as its own ``python -m bench.<name>`` process, one after another, so one never
times another. Its printed table goes to the terminal and to ``bench/results/<name>.log``; the suite's
own record (wall and CPU time of each step, load average before and after) to ``bench/results/suite.json``.
The speed-vs-TRL step needs ``.venv-bench`` (``make bench-env``); without it that row says so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench.common import RESULTS, load_average, machine

DOC = Path(__file__).parent.parent / "docs" / "benchmarks.md"

SUITE: list[tuple[str, list[str]]] = [
    # (module name under bench/, its arguments): the order keeps the expensive memory run first.
    ("update_memory", []),
    ("speed_vs_trl", ["--precisions", "fp32,bf16"]),
    ("logprobs", []),
    ("sampler", []),
    ("engine_throughput", []),
    ("generation", ["--compile"]),
    ("tool_calls", []),
    ("ahead_pass", []),
    ("lightning_overhead", []),
    ("weight_sync", ["--repeats", "3"]),
    ("oom_acceptance", []),
    ("budget_speed", []),
    ("packing", []),
    ("lora", []),
    ("server_sync", ["--repeats", "3"]),
    ("async", ["--rounds", "3"]),
    ("async", ["--reward", "--seeds", "0,1,2"]),
    ("inflight", ["--rounds", "3"]),
]


def run(name: str, args: list[str]) -> dict:
    """One benchmark process: its output streamed to the terminal and a log; wall/CPU seconds and load recorded."""
    cmd = [sys.executable, "-m", f"bench.{name}", *args]
    before, cpu0, t0 = load_average(), _children_cpu(), time.perf_counter()
    log = RESULTS / f"{name}.log"
    RESULTS.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})
        for line in proc.stdout:
            f.write(line)
            if _worth_showing(line):
                print(line, end="", flush=True)
        rc = proc.wait()
    return {"name": name, "command": " ".join(["python", "-m", f"bench.{name}", *args]), "rc": rc,
            "wall_s": time.perf_counter() - t0, "cpu_s": _children_cpu() - cpu0,
            "load_before": before, "load_after": load_average()}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _worth_showing(line: str) -> bool:
    """The tables and summaries, not the libraries' progress bars and INFO lines."""
    noise = ("Loading", "INFO", "WARNING", "[W", "Writing", "GPU available", "TPU available", "💡", "`Trainer.fit`",
             "warnings.warn", "Triton")
    return not any(n in line for n in noise)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma list of benchmark names to run (the doc still shows every result)")
    ap.add_argument("--doc-only", action="store_true", help="only re-render docs/benchmarks.md from the JSON results")
    a = ap.parse_args()
    from bench.report import render

    if not a.doc_only:
        only = set(a.only.split(",")) if a.only else None
        start, steps = time.perf_counter(), []
        for name, args in SUITE:
            if only is None or name in only:
                print(f"\n=== bench.{name} {' '.join(args)}", flush=True)
                steps.append(run(name, args))
                s = steps[-1]
                print(f"--- {name}: rc={s['rc']}, {s['wall_s']:.0f} s wall, {s['cpu_s']:.0f} s CPU, load average "
                      f"{s['load_before']:.1f} -> {s['load_after']:.1f}", flush=True)
        suite = {"machine": machine(), "steps": steps, "wall_s": time.perf_counter() - start,
                 "cpu_s": sum(s["cpu_s"] for s in steps), "partial": only is not None,
                 "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        (RESULTS / ("suite_partial.json" if only else "suite.json")).write_text(json.dumps(suite, indent=2))
        print(f"\nsuite: {suite['wall_s'] / 60:.1f} min wall, {suite['cpu_s'] / 60:.1f} min CPU")
    DOC.write_text(render(RESULTS))
    print(f"wrote {DOC}")
    failed = [] if a.doc_only else [s["name"] for s in steps if s["rc"]]
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (see bench/results/<name>.log)")


if __name__ == "__main__":
    main()
