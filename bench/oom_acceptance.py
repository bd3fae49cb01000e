"""The OOM acceptance run, on CPU: a data-dependent out-of-memory, fixed by the token budget.

    .venv/bin/python -m bench.oom_acceptance            # 32 sequences a step, vocab 32768, the long step at 512
    .venv/bin/python -m bench.oom_acceptance --quick    # 16 sequences, shorter completions

The design's case scaled to this machine: a collected batch of ``--rows`` sequences (the design: 256 x 2048),
four loop steps whose completions are short on steps 1-3 and long on step 4 ("steps 1-3 fit, step 4 did
not"), vocabulary 32768. Each arm trains the same four steps in a fresh child process whose address space
is capped (``resource.setrlimit(RLIMIT_AS)``) at the memory it holds once policy, optimizer and threads
exist, plus ``--headroom-mb`` for the update:

* ``unchunked``: the whole batch in one forward/backward (``micro_batch_per_replica = 0``);
* ``fixed``: ``n_micro`` sized for the *mean* length (the chunk that holds ``--budget`` tokens of a short step);
* ``token``: ``rl.max_tokens_per_micro = --budget``.

A child stops at its first out-of-memory error. Per step it reports the update's peak memory (the peak RSS
during the step, the kernel's high-water mark reset just before it, minus the RSS before it), the chunk count
and the seconds. Expected: unchunked fails on step 1, fixed on step 4, the token budget completes all four.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time

from bench.common import load_average, pyplot, run_child, save, table
from bench.update_memory import _reset_peak, _status_mb

ARMS = ("unchunked", "fixed", "token")
PROMPT = 16


def lengths_of(step: int, rows: int, short: tuple[int, int], long: tuple[int, int]):
    """Completion lengths of loop step ``step`` (0-based): short on steps 0-2, long on step 3. Seeded."""
    import torch

    lo, hi = long if step == 3 else short
    return torch.randint(lo, hi + 1, (rows,), generator=torch.Generator().manual_seed(100 + step))


def batch_of(lengths, vocab: int):
    import torch

    from lightning_grpo.batch import RolloutBatch

    rows, width = len(lengths), PROMPT + int(lengths.max())
    g = torch.Generator().manual_seed(int(lengths.sum()))
    pos = torch.arange(width)
    attn = pos < (PROMPT + lengths).unsqueeze(1)
    return RolloutBatch(input_ids=torch.randint(4, vocab, (rows, width), generator=g), attention_mask=attn,
                        completion_mask=attn & (pos >= PROMPT), advantages=torch.randn(rows, generator=g),
                        rewards=torch.rand(rows, generator=g), group_ids=torch.arange(rows) // 8,
                        sample_ids=torch.arange(rows))


def child(arm: str, a: argparse.Namespace) -> dict:
    import torch

    from lightning_grpo.config import GRPOConfig
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.tiny.spec import TinyPolicySpec

    torch.manual_seed(0)
    spec = TinyPolicySpec(hidden_size=a.hidden, num_layers=a.layers, num_heads=a.hidden // 64, num_kv_heads=1,
                          intermediate_size=3 * a.hidden, vocab_size=a.vocab,
                          max_position_embeddings=PROMPT + a.long[1] + 16)
    sizes = {"unchunked": {}, "fixed": {"micro_batch_per_replica": a.rows // a.n_micro},
             "token": {"max_tokens_per_micro": a.budget}}[arm]
    rl = GRPOConfig(batch_per_replica=a.rows, group_size=8, max_grad_norm=1.0, **sizes)
    module = GRPOModule(policy=PolicyConfig(path="tiny:bench-oom", tiny=spec), rl=rl)
    module.configure_model()
    module.updater.attach(torch.optim.AdamW(module.policy.parameters(), lr=1e-5))
    for p in module.policy.parameters():  # the optimizer state exists before the cap, like after a first step
        module.updater.loop.accumulator.optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                                      "exp_avg_sq": torch.zeros_like(p)}
    with torch.no_grad():  # start the thread pool (its stacks are address space too) before the cap
        module.scorer.logprobs(module.policy, batch_of(torch.tensor([4, 4]), a.vocab))
    base_vm = _status_mb("VmSize")
    cap = int((base_vm + a.headroom_mb) * 2**20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    steps = []
    for step in range(4):
        lengths = lengths_of(step, a.rows, a.short, a.long)
        batch = batch_of(lengths, a.vocab)
        base, reset = _status_mb("VmRSS"), _reset_peak()
        t0 = time.perf_counter()
        record = {"step": step + 1, "completion_mean": float(lengths.float().mean()),
                  "completion_max": int(lengths.max())}
        try:
            module.updater.update(batch)
        except (MemoryError, RuntimeError) as err:  # torch's CPU allocator raises RuntimeError
            if "alloc" not in str(err).lower() and not isinstance(err, MemoryError):
                raise
            record.update(outcome="OOM", error=str(err).splitlines()[0][:160])
            steps.append(record)
            break
        peak = _status_mb("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        plan = module.updater.last_plan
        record.update(outcome="ok", update_peak_mb=peak - base, seconds=time.perf_counter() - t0,
                      chunks=plan.real_chunks, largest_chunk_tokens=max(
                          len(r) * int(batch.attention_mask[list(r)].sum(-1).max()) for c in plan.rows for r in c if r))
        steps.append(record)
    return {"arm": arm, "cap_mb": cap / 2**20, "base_vm_mb": base_vm, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child")
    ap.add_argument("--rows", type=int)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--short", type=int, nargs=2, help="completion lengths of steps 1-3 (min max)")
    ap.add_argument("--long", type=int, nargs=2, help="completion lengths of step 4 (min max)")
    ap.add_argument("--budget", type=int, help="rl.max_tokens_per_micro of the token arm")
    ap.add_argument("--n-micro", type=int, help="the fixed arm's n_micro (default: sized for the mean length)")
    ap.add_argument("--headroom-mb", type=float, help="address space allowed above the resident policy")
    a = ap.parse_args()
    a.rows = a.rows or (16 if a.quick else 32)
    a.short = a.short or ([24, 96] if a.quick else [32, 128])
    a.long = a.long or ([192, 256] if a.quick else [384, 512])
    a.budget = a.budget or (1024 if a.quick else 2048)
    if a.n_micro is None:  # the fixed count sized for the mean length: a short step's chunk holds ~budget tokens
        mean_width = PROMPT + sum(a.short) / 2
        a.n_micro = next(n for n in range(1, a.rows + 1) if a.rows % n == 0 and a.rows / n * mean_width <= a.budget)
    a.headroom_mb = a.headroom_mb or (700 if a.quick else 1700)
    if a.child:
        print(json.dumps(child(a.child, a)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
    args = ["--rows", str(a.rows), "--vocab", str(a.vocab), "--hidden", str(a.hidden), "--layers", str(a.layers),
            "--short", *map(str, a.short), "--long", *map(str, a.long), "--budget", str(a.budget),
            "--n-micro", str(a.n_micro), "--headroom-mb", str(a.headroom_mb)]
    load, start = [load_average()], time.perf_counter()
    results = [run_child("bench.oom_acceptance", "--child", arm, *args, env=env) for arm in ARMS]
    load.append(load_average())
    rows = [{"arm": r["arm"], **s} for r in results for s in r["steps"]]
    for row in rows:
        row.setdefault("update_peak_mb", math.nan)
        row.setdefault("chunks", 0)
        row.setdefault("seconds", math.nan)
    print(f"OOM acceptance: {a.rows} sequences a step, prompt {PROMPT}, completions {a.short} on steps 1-3 and "
          f"{a.long} on step 4, vocab {a.vocab}, policy hidden {a.hidden} x {a.layers} layers; address space capped "
          f"at the resident process + {a.headroom_mb:.0f} MB; fixed n_micro={a.n_micro}, token budget {a.budget}; "
          f"load average {min(load):.1f}-{max(load):.1f}")
    print(table(rows, ["arm", "step", "completion_mean", "completion_max", "outcome", "chunks", "update_peak_mb",
                       "seconds"]))
    verdict = {r["arm"]: _verdict(r["steps"]) for r in results}
    print("\n" + "; ".join(f"{arm}: {v}" for arm, v in verdict.items()))
    path = save("oom_acceptance", {"rows": a.rows, "prompt": PROMPT, "short": a.short, "long": a.long,
                                   "vocab": a.vocab, "hidden": a.hidden, "layers": a.layers, "budget": a.budget,
                                   "n_micro": a.n_micro, "headroom_mb": a.headroom_mb, "results": results,
                                   "verdict": verdict, "load_average": load,
                                   "seconds": time.perf_counter() - start,
                                   "command": " ".join(["python -m bench.oom_acceptance", *sys.argv[1:]])})
    plot(results, a, path.with_suffix(".png"))
    print(f"wrote {path}", file=sys.stderr)


def _verdict(steps: list[dict]) -> str:
    failed = next((s["step"] for s in steps if s["outcome"] == "OOM"), None)
    return f"out of memory at step {failed}" if failed else f"completed all {len(steps)} steps"


def plot(results: list[dict], a: argparse.Namespace, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    for r, style in zip(results, ("o-", "s-", "^-")):
        ok = [s for s in r["steps"] if s["outcome"] == "ok"]
        line = ax.plot([s["step"] for s in ok], [s["update_peak_mb"] for s in ok], style, label=r["arm"])[0]
        for s in r["steps"]:
            if s["outcome"] == "OOM":
                ax.plot([s["step"]], [a.headroom_mb], "x", color=line.get_color(), ms=12, mew=2)
    ax.axhline(a.headroom_mb, color="grey", lw=0.8, ls=":",
               label=f"address-space cap: resident + {a.headroom_mb:.0f} MB")
    ax.set_xticks([1, 2, 3, 4], ["1 short", "2 short", "3 short", "4 long"])
    ax.set_xlabel("loop step (completions)")
    ax.set_ylabel("update peak MB (x = out of memory)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(f"{a.rows} sequences, vocab {a.vocab}: fixed n_micro={a.n_micro} vs token budget {a.budget}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
