"""Peak memory of one update vs micro-batching, on a shape where the logits dominate (as in real OOMs).

    .venv/bin/python -m bench.update_memory            # full shape: 64 x 512 completion tokens, vocab 32k
    .venv/bin/python -m bench.update_memory --quick    # 16 x 256, for a fast look

Each n_micro runs in a fresh process (``--jobs`` of them at a time: memory does not depend on timing,
and one thread each). We report the process peak RSS and the update's own peak: the peak RSS reached
during the update (the kernel's high-water mark is reset just before it, ``/proc/self/clear_refs``)
minus the RSS just before it (policy, optimizer and batch resident), and both ratios to n_micro = 1.
The target (issue 10) is an update peak at n_micro = 8 of at most 0.3x the n_micro = 1 peak.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from concurrent.futures import ThreadPoolExecutor

from bench.common import load_average, pyplot, run_child, save, table

N_MICROS = [1, 2, 4, 8, 16]
TARGET_N_MICRO, TARGET_RATIO = 8, 0.3


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(n_micro: int, rows: int, completion: int, vocab: int) -> dict:
    import time

    import torch

    from lightning_grpo.batch import RolloutBatch
    from lightning_grpo.config import GRPOConfig
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.tiny.spec import TinyPolicySpec

    torch.manual_seed(0)
    spec = TinyPolicySpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                          vocab_size=vocab, max_position_embeddings=completion + 64)
    rl = GRPOConfig(batch_per_replica=rows, group_size=8, micro_batch_per_replica=rows // n_micro, max_grad_norm=1.0)
    module = GRPOModule(policy=PolicyConfig(path="tiny:bench-memory", tiny=spec), rl=rl)
    module.configure_model()
    module.updater.attach(torch.optim.AdamW(module.policy.parameters(), lr=1e-5))
    prompt, width = 16, 16 + completion
    lengths = torch.randint(completion // 4, completion + 1, (rows,))  # unequal, like real completions
    ids = torch.randint(4, vocab, (rows, width))
    pos = torch.arange(width)
    attn = pos < (prompt + lengths).unsqueeze(1)
    batch = RolloutBatch(input_ids=ids, attention_mask=attn, completion_mask=attn & (pos >= prompt),
                         advantages=torch.randn(rows), rewards=torch.rand(rows), group_ids=torch.arange(rows) // 8,
                         sample_ids=torch.arange(rows))
    base, reset = _status_mb("VmRSS"), _reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    module.updater.update(batch)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    update_peak = _status_mb("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the whole process, build included
    return {"n_micro": n_micro, "peak_rss_mb": peak, "update_peak_mb": update_peak - base, "base_rss_mb": base,
            "seconds": seconds, "cpu_seconds": cpu}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", type=int)
    ap.add_argument("--rows", type=int)
    ap.add_argument("--completion", type=int)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--jobs", type=int, default=3, help="children at a time (peak RSS is per process)")
    a = ap.parse_args()
    rows = a.rows or (16 if a.quick else 64)
    completion = a.completion or (256 if a.quick else 512)
    if a.child:
        print(json.dumps(child(a.child, rows, completion, a.vocab)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    load = [load_average()]

    def one(n: int) -> dict:
        return run_child("bench.update_memory", "--child", str(n), "--rows", str(rows), "--completion",
                         str(completion), "--vocab", str(a.vocab), env=env)

    with ThreadPoolExecutor(a.jobs) as pool:
        results = list(pool.map(one, [n for n in N_MICROS if rows % n == 0]))
    load.append(load_average())
    base = results[0]
    for r in results:
        r["ratio_update_peak"] = r["update_peak_mb"] / base["update_peak_mb"]
        r["ratio_process_peak"] = r["peak_rss_mb"] / base["peak_rss_mb"]
    target = next((r["ratio_update_peak"] for r in results if r["n_micro"] == TARGET_N_MICRO), None)
    print(f"update memory, {rows} sequences x {completion} completion tokens, vocab {a.vocab}; {a.jobs} at a time, "
          f"load average {min(load):.1f}-{max(load):.1f}")
    print(table(results, ["n_micro", "peak_rss_mb", "update_peak_mb", "ratio_update_peak", "ratio_process_peak",
                          "seconds", "cpu_seconds"]))
    if target is not None:
        print(f"\nupdate peak at n_micro={TARGET_N_MICRO}: {target:.2f}x n_micro=1 (target <= {TARGET_RATIO})")
    path = save("update_memory", {"rows": rows, "completion": completion, "vocab": a.vocab, "results": results,
                                  "jobs": a.jobs, "load_average": load, "target_ratio": TARGET_RATIO,
                                  "target_n_micro": TARGET_N_MICRO, "ratio_at_target": target,
                                  "command": " ".join(["python -m bench.update_memory", *sys.argv[1:]])})
    plot(results, path.with_suffix(".png"), f"{rows} x {completion} tokens, vocab {a.vocab}")
    print(f"wrote {path}", file=sys.stderr)


def plot(results: list[dict], path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax, rx) = plt.subplots(1, 2, figsize=(9, 3.5))
    xs = [r["n_micro"] for r in results]
    ax.plot(xs, [r["update_peak_mb"] for r in results], "o-", label="update peak (above pre-update RSS)")
    ax.plot(xs, [r["peak_rss_mb"] for r in results], "s--", label="process peak RSS")
    rx.plot(xs, [r["ratio_update_peak"] for r in results], "o-", label="update peak")
    rx.plot(xs, [r["ratio_process_peak"] for r in results], "s--", label="process peak")
    rx.axhline(TARGET_RATIO, color="grey", lw=0.8, ls=":", label=f"target at n_micro={TARGET_N_MICRO}: <= {TARGET_RATIO}")
    for axis in (ax, rx):
        axis.set_xscale("log", base=2)
        axis.set_xticks(xs, [str(x) for x in xs])
        axis.set_xlabel("n_micro (chunks per optimizer step)")
        axis.legend(fontsize=8)
    ax.set_ylabel("MB")
    ax.set_ylim(bottom=0)
    rx.set_ylabel("ratio to n_micro = 1")
    rx.set_ylim(0, 1.05)
    fig.suptitle(f"One update's peak memory, {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
