"""Peak memory of one update vs micro-batching, on a shape where the logits dominate (as in real OOMs).

    .venv/bin/python -m bench.update_memory            # full shape: 64 x 512 completion tokens, vocab 32k
    .venv/bin/python -m bench.update_memory --quick    # 16 x 256, for a fast look

Each n_micro runs in a fresh process; we report the process peak RSS and the update's own
peak (peak RSS minus the RSS just before the update), and its ratio to n_micro = 1.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys

from bench.common import run_child, save, table

N_MICROS = [1, 2, 4, 8, 16]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def child(n_micro: int, rows: int, completion: int, vocab: int) -> dict:
    import time

    import torch

    from lightning_grpo.batch import RolloutBatch
    from lightning_grpo.config import GRPOConfig
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.policy import PolicyConfig, TinyPolicySpec

    torch.manual_seed(0)
    spec = TinyPolicySpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                          vocab_size=vocab, max_position_embeddings=completion + 64)
    rl = GRPOConfig(batch_per_replica=rows, group_size=8, micro_batch_per_replica=rows // n_micro, max_grad_norm=1.0)
    module = GRPOModule(policy=PolicyConfig(path="tiny:bench-memory", tiny=spec), rl=rl)
    module.loop = module.make_loop(torch.optim.AdamW(module.policy.parameters(), lr=1e-5))
    prompt, width = 16, 16 + completion
    lengths = torch.randint(completion // 4, completion + 1, (rows,))  # unequal, like real completions
    ids = torch.randint(4, vocab, (rows, width))
    pos = torch.arange(width)
    attn = pos < (prompt + lengths).unsqueeze(1)
    batch = RolloutBatch(input_ids=ids, attention_mask=attn, completion_mask=attn & (pos >= prompt),
                         advantages=torch.randn(rows), rewards=torch.rand(rows), group_ids=torch.arange(rows) // 8,
                         sample_ids=torch.arange(rows))
    base = _rss_mb()
    t0 = time.perf_counter()
    module.update(batch)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"n_micro": n_micro, "peak_rss_mb": peak, "update_peak_mb": peak - base, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", type=int)
    ap.add_argument("--rows", type=int)
    ap.add_argument("--completion", type=int)
    ap.add_argument("--vocab", type=int, default=32768)
    a = ap.parse_args()
    rows = a.rows or (16 if a.quick else 64)
    completion = a.completion or (256 if a.quick else 512)
    if a.child:
        print(json.dumps(child(a.child, rows, completion, a.vocab)))
        return
    results = [run_child("bench.update_memory", "--child", str(n), "--rows", str(rows), "--completion",
                         str(completion), "--vocab", str(a.vocab)) for n in N_MICROS if rows % n == 0]
    base = results[0]
    for r in results:
        r["ratio_update_peak"] = r["update_peak_mb"] / base["update_peak_mb"]
        r["ratio_process_peak"] = r["peak_rss_mb"] / base["peak_rss_mb"]
    print(f"update memory, {rows} sequences x {completion} completion tokens, vocab {a.vocab}")
    print(table(results, ["n_micro", "peak_rss_mb", "update_peak_mb", "ratio_update_peak", "ratio_process_peak",
                          "seconds"]))
    path = save("update_memory", {"rows": rows, "completion": completion, "vocab": a.vocab, "results": results,
                                  "command": "python -m bench.update_memory" + (" --quick" if a.quick else "")})
    plot(results, path.with_suffix(".png"), f"{rows} x {completion} tokens, vocab {a.vocab}")
    print(f"wrote {path}", file=sys.stderr)


def plot(results: list[dict], path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [r["n_micro"] for r in results]
    ax.plot(xs, [r["update_peak_mb"] for r in results], "o-", label="update peak (MB)")
    ax.plot(xs, [r["peak_rss_mb"] for r in results], "s--", label="process peak RSS (MB)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("n_micro (chunks per optimizer step)")
    ax.set_ylabel("MB")
    ax.set_title(f"One update's peak memory\n{title}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
