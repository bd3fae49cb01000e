"""Speed of the balanced token-budgeted plan vs the fixed chunk count, on a long-tail length distribution.

    .venv/bin/python -m bench.budget_speed            # 64 sequences, completions mostly 8-48 tokens, 1 in 8 up to 384
    .venv/bin/python -m bench.budget_speed --quick    # 32 sequences, a shorter tail

A fixed count cuts contiguous rows: with a long tail, most chunks hold one long completion and pad every
other row to it. The token budget sorts rows by length into balanced chunks that each pad only to their own
longest row. For a like-for-like memory bound the budget is the fixed plan's largest chunk cost (rows x
longest), so neither plan ever builds a bigger chunk than the other. Both arms train the same collected
batches on copies of one policy in one process, alternating, one thread; each figure is the median over
``--repeats`` loop steps after one warm-up. Ratio = fixed seconds / token-budget seconds (> 1: faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from bench.common import clocks, load_average, run_child, save, since, table

PROMPT = 16


def long_tail(rows: int, short: tuple[int, int], tail: tuple[int, int], tail_share: float, seed: int):
    """Completion lengths: mostly short, ``tail_share`` of them long (seeded, shuffled across the batch)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n_tail = max(1, round(rows * tail_share))
    lengths = torch.cat([torch.randint(tail[0], tail[1] + 1, (n_tail,), generator=g),
                         torch.randint(short[0], short[1] + 1, (rows - n_tail,), generator=g)])
    return lengths[torch.randperm(rows, generator=g)]


def child(a: argparse.Namespace) -> dict:
    import torch

    from bench.oom_acceptance import batch_of
    from lightning_grpo.config import GRPOConfig
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.tiny.spec import TinyPolicySpec
    from lightning_grpo.update.plan import ChunkPlan, sequence_lengths

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the machine is shared: one thread keeps wall time proportional to work done
    spec = TinyPolicySpec(vocab_size=a.vocab, max_position_embeddings=PROMPT + a.tail[1] + 16)  # hidden 128, 2 layers
    batches = [batch_of(long_tail(a.rows, a.short, a.tail, a.tail_share, seed), a.vocab)
               for seed in range(a.repeats + 1)]

    def plan_cost(batch, plan: ChunkPlan) -> tuple[int, int]:
        lengths, _ = sequence_lengths(batch)
        costs = [len(r) * max(max(lengths[i] for i in r), 2) for c in plan.rows for r in c if r]
        return max(costs), sum(costs)

    fixed_plans = [ChunkPlan.fixed(a.rows, 1, a.n_micro) for _ in batches]
    budget = max(plan_cost(b, p)[0] for b, p in zip(batches, fixed_plans))  # the same worst chunk as fixed
    arms = {"fixed": GRPOConfig(batch_per_replica=a.rows, group_size=8, micro_batch_per_replica=a.rows // a.n_micro),
            "token": GRPOConfig(batch_per_replica=a.rows, group_size=8, max_tokens_per_micro=budget)}
    modules = {}
    for name, rl in arms.items():
        module = GRPOModule(policy=PolicyConfig(path="tiny:bench-budget", tiny=spec), rl=rl, seed=0)
        module.configure_model()  # a tiny policy is built from the seed: the same weights in both arms
        module.updater.attach(torch.optim.AdamW(module.policy.parameters(), lr=1e-5))
        modules[name] = module
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    padded: dict[str, list[int]] = {name: [] for name in arms}
    chunks: dict[str, list[int]] = {name: [] for name in arms}
    for i, batch in enumerate(batches):
        for name, module in modules.items():
            start = clocks()
            module.updater.update(batch)
            if i:  # the first batch warms up allocator and kernels
                times[name].append(since(start))
                padded[name].append(plan_cost(batch, module.updater.last_plan)[1])
                chunks[name].append(module.updater.last_plan.real_chunks)
    out = []
    for name in arms:
        wall = statistics.median(t[0] for t in times[name])
        cpu = statistics.median(t[1] for t in times[name])
        out.append({"arm": name, "wall_s": wall, "cpu_s": cpu, "padded_tokens": statistics.median(padded[name]),
                    "chunks": statistics.median(chunks[name])})
    real = statistics.median(int(b.attention_mask.sum()) for b in batches[1:])
    return {"results": out, "budget": budget, "real_tokens": real}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--rows", type=int)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--n-micro", type=int, default=8)
    ap.add_argument("--short", type=int, nargs=2)
    ap.add_argument("--tail", type=int, nargs=2)
    ap.add_argument("--tail-share", type=float, default=0.125)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    a.rows = a.rows or (32 if a.quick else 64)
    a.short = a.short or [8, 48]
    a.tail = a.tail or ([128, 192] if a.quick else [256, 384])
    if a.child:
        print(json.dumps(child(a)))
        return
    args = ["--child", "--rows", str(a.rows), "--vocab", str(a.vocab), "--n-micro", str(a.n_micro), "--short",
            *map(str, a.short), "--tail", *map(str, a.tail), "--tail-share", str(a.tail_share), "--repeats",
            str(a.repeats)]
    load = [load_average()]
    d = run_child("bench.budget_speed", *args)
    load.append(load_average())
    fixed, token = (next(r for r in d["results"] if r["arm"] == arm) for arm in ("fixed", "token"))
    ratio = {"wall": fixed["wall_s"] / token["wall_s"], "cpu": fixed["cpu_s"] / token["cpu_s"],
             "padded_tokens": fixed["padded_tokens"] / token["padded_tokens"]}
    print(f"token budget vs fixed n_micro={a.n_micro}: {a.rows} sequences, completions {a.short} with "
          f"{a.tail_share:.0%} in {a.tail}, vocab {a.vocab}; budget {d['budget']} tokens (the fixed plan's largest "
          f"chunk); {d['real_tokens']} real tokens a batch; load average {min(load):.1f}-{max(load):.1f}")
    print(table(d["results"], ["arm", "chunks", "padded_tokens", "wall_s", "cpu_s"]))
    print(f"\nfixed / token budget: {ratio['cpu']:.2f}x CPU time, {ratio['wall']:.2f}x wall, "
          f"{ratio['padded_tokens']:.2f}x padded tokens")
    path = save("budget_speed", {**d, "rows": a.rows, "vocab": a.vocab, "n_micro": a.n_micro, "short": a.short,
                                 "tail": a.tail, "tail_share": a.tail_share, "repeats": a.repeats, "ratio": ratio,
                                 "load_average": load,
                                 "command": " ".join(["python -m bench.budget_speed", *sys.argv[1:]])})
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
