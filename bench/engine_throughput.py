"""Generation throughput: transformers ``generate`` (HFEngine) vs vLLM's CPU build (VLLMEngine), group sizes 4/8/16.

    .venv/bin/python -m bench.engine_throughput            # the speed bench's ~30M Qwen2 policy, 4 prompts x 64 tokens
    .venv/bin/python -m bench.engine_throughput --quick    # group sizes 4 and 8 only

Each engine runs in its own fresh process with the same thread count, the two at the same time (``--sequential``:
one after the other); inside it every group size is drawn
``--repeats`` times after one warm-up draw, and the median is reported. ``tokens/s`` counts completion tokens
actually produced (a completion may stop early at EOS), per wall second and per CPU second of the process;
the vLLM / transformers ratio uses CPU seconds, since the machine is shared and the runs are not simultaneous. Both sample at temperature 1 in float32 with the
same seed stream; the vLLM engine is built eager (no torch.compile) with a fixed KV cache, as in the speed bench,
and its build time is reported separately (a loop pays it once per job).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from bench.common import clocks, load_average, run_child, save, since, table

GROUPS = [4, 8, 16]
PROMPTS, NEW_TOKENS = 4, 64


def child(engine_name: str, groups: list[int], repeats: int) -> dict:
    import torch

    from bench.speed_vs_trl import KV_CACHE_BYTES, POLICY, policy_dir, prompt_rows
    from lightning_grpo.policy import PolicyConfig, load_policy
    from lightning_grpo.rollout.base import SamplingConfig
    from lightning_grpo.rollout.hf import HFEngine
    from lightning_grpo.rollout.vllm import VLLMConfig, VLLMEngine

    path = policy_dir()
    model, tok = load_policy(PolicyConfig(path=str(path)))
    start = time.perf_counter()
    if engine_name == "hf":
        engine = HFEngine(model, tok)
    else:
        engine = VLLMEngine(path, VLLMConfig(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=KV_CACHE_BYTES,
                                             max_model_len=POLICY["max_position_embeddings"]))
    build_s = time.perf_counter() - start
    from lightning_grpo.rollout.base import Prompt

    prompts = [Prompt(i, tok(r["prompt"])["input_ids"], r["prompt"], r["answer"])
               for i, r in enumerate(prompt_rows(PROMPTS))]
    engine.generate(prompts, groups[0], SamplingConfig(max_new_tokens=NEW_TOKENS, seed=0))  # warm-up
    rows = []
    for g in groups:
        secs, cpus, toks = [], [], []
        for r in range(repeats):
            t0 = clocks()
            out = engine.generate(prompts, g, SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=r + 1))
            wall, cpu = since(t0)
            secs.append(wall)
            cpus.append(cpu)
            toks.append(sum(len(o.token_ids) for o in out))
        s, c, t = statistics.median(secs), statistics.median(cpus), statistics.median(toks)
        rows.append({"engine": engine_name, "group": g, "sequences": PROMPTS * g, "tokens": t, "seconds": s,
                     "cpu_seconds": c, "tokens_per_s": t / s, "cpu_tokens_per_s": t / c})
    return {"rows": rows, "build_s": build_s, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sequential", action="store_true", help="run the two engines one after the other")
    ap.add_argument("--child", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--groups", default=",".join(map(str, GROUPS)), help=argparse.SUPPRESS)
    a = ap.parse_args()
    groups = [int(g) for g in a.groups.split(",")]
    if a.child:
        print(json.dumps(child(a.child, groups, a.repeats)))
        return
    if a.quick:
        groups = [4, 8]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TOKENIZERS_PARALLELISM": "false"}
    load = [load_average()]

    def one(name: str) -> dict:
        return run_child("bench.engine_throughput", "--child", name, "--repeats", str(a.repeats),
                         "--groups", ",".join(map(str, groups)), env=env)

    names = ("hf", "vllm")
    if a.sequential:
        results = {n: one(n) for n in names}
    else:  # both at once: the same neighbours' load for both (each has a core on an idle 2-core machine)
        with ThreadPoolExecutor(2) as pool:
            results = dict(zip(names, pool.map(one, names)))
    load.append(load_average())
    rows = results["hf"]["rows"] + results["vllm"]["rows"]
    # the ratio in CPU time (the work done): the two engines ran at different moments of a shared machine
    speedup = {g: next(r["cpu_tokens_per_s"] for r in results["vllm"]["rows"] if r["group"] == g)
               / next(r["cpu_tokens_per_s"] for r in results["hf"]["rows"] if r["group"] == g) for g in groups}
    for r in rows:
        r["vllm_over_hf"] = speedup[r["group"]]
    print(f"generation throughput, {PROMPTS} prompts x group x up to {NEW_TOKENS} new tokens, {a.threads} thread(s), "
          f"load average {min(load):.1f}-{max(load):.1f}; vLLM engine build {results['vllm']['build_s']:.1f} s")
    print(table(rows, ["engine", "group", "sequences", "tokens", "seconds", "cpu_seconds", "tokens_per_s",
                       "cpu_tokens_per_s", "vllm_over_hf"]))
    path = save("engine_throughput", {"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "threads": a.threads,
                                      "repeats": a.repeats, "rows": rows, "vllm_over_hf": speedup,
                                      "vllm_build_s": results["vllm"]["build_s"], "load_average": load,
                                      "command": "python -m bench.engine_throughput" + (" --quick" if a.quick else "")})
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path}", file=sys.stderr)


def plot(rows: list[dict], path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, style in (("hf", "s--"), ("vllm", "o-")):
        pts = [r for r in rows if r["engine"] == name]
        ax.plot([r["group"] for r in pts], [r["cpu_tokens_per_s"] for r in pts], style,
                label={"hf": "transformers generate", "vllm": "vLLM (CPU build)"}[name])
    ax.set_xscale("log", base=2)
    ax.set_xticks(GROUPS, [str(g) for g in GROUPS])
    ax.set_xlabel(f"group size ({PROMPTS} prompts)")
    ax.set_ylabel("completion tokens per CPU second")
    ax.set_title("Generation throughput, ~30M Qwen2 (32k vocab), CPU", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
