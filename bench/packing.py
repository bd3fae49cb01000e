"""Padding-free packed chunks vs padded token-budgeted chunks, on long-tail lengths (issue 32).

    .venv/bin/python -m bench.packing            # 64 sequences, completions ~64 tokens, 10% of them 8x (512); ~30M
    .venv/bin/python -m bench.packing --quick    # 32 sequences, a shorter tail, a 1.5M policy

Three arms train the same collected batches on copies of one policy in one process, one thread, alternating round by
round (interleaved, so load drifts hit every arm alike); each figure is the median over ``--repeats`` loop steps after
one warm-up:

* *padded*: ``rl.max_tokens_per_micro = budget``, ``rl.packed = false``: rows sorted by length, each chunk padded to
  its longest row (what the budget did before packing);
* *packed*: the same budget counting real tokens, ``rl.packed = true``: each chunk one sequence, per-row attention;
* *fixed*: ``n_micro = 8`` contiguous chunks, padded (no budget; the plain micro-batch split).

*tokens* = tokens the decoder processes (padded: rows x longest per chunk; packed: real tokens). *FLOPs* = torch's
FLOP counter over one update (forward + backward + fused head; SDPA counted as its full causal square), and its ratio
to ``6 x params x real tokens``. *peak MB* = the update's own peak RSS (high-water mark reset before it, minus the
RSS before it), each arm in a fresh process. The *attention* rows time one decoder forward+backward of the packed
plan's largest chunk with the per-row SDPA used here vs transformers' own packed path (restarting ``position_ids``, no
attention mask: a block-diagonal ``[R, R]`` mask for SDPA): why per-row SDPA was picked on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from bench.common import clocks, load_average, run_child, save, since, table

PROMPT = 16
ARMS = ("padded", "packed", "fixed")


def lengths_of(a: argparse.Namespace, seed: int):
    """Completion lengths: median ``a.median``, ``a.tail_share`` of the rows ``a.tail_factor`` x it (+-6%)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n_tail = max(1, round(a.rows * a.tail_share))
    m, tail = a.median, a.median * a.tail_factor
    short = torch.randint(m // 2, m + m // 2 + 1, (a.rows - n_tail,), generator=g)
    long = torch.randint(tail - tail // 16, tail + tail // 16 + 1, (n_tail,), generator=g)
    return torch.cat([long, short])[torch.randperm(a.rows, generator=g)]


def build(a: argparse.Namespace, arm: str):
    import torch

    from lightning_grpo.config import GRPOConfig
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.tiny.spec import TinyPolicySpec

    spec = TinyPolicySpec(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                          num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv_heads,
                          max_position_embeddings=PROMPT + 2 * a.median * a.tail_factor)
    split = ({"micro_batch_per_replica": a.rows // 8} if arm == "fixed" else {"max_tokens_per_micro": a.budget})
    rl = GRPOConfig(batch_per_replica=a.rows, group_size=8, packed=arm == "packed", **split)
    module = GRPOModule(policy=PolicyConfig(path="tiny:bench-packing", tiny=spec), rl=rl, seed=0)
    module.configure_model()  # a tiny policy is built from the seed: the same weights in every arm
    module.updater.attach(torch.optim.AdamW(module.policy.parameters(), lr=1e-5))
    return module


def plan_tokens(batch, plan, packed: bool) -> int:
    from lightning_grpo.update.plan import sequence_lengths

    lengths, _ = sequence_lengths(batch)
    cost = (lambda r: sum(lengths[i] for i in r)) if packed else (lambda r: len(r) * max(lengths[i] for i in r))
    return sum(cost(r) for chunks in plan.rows for r in chunks if r)


def flops_of(module, batch) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        module.updater.update(batch)
    return counter.get_total_flops()


def attention_rows(a: argparse.Namespace, module, batch) -> list[dict]:
    """One decoder forward+backward of the packed plan's largest chunk: per-row SDPA vs a block-diagonal mask."""
    from lightning_grpo.packing import pack, packed_attention
    from lightning_grpo.update.plan import take

    plan = module.updater.plan(batch)[0]
    rows = max((r for chunks in plan.rows for r in chunks if r), key=lambda r: int(batch.attention_mask[list(r)].sum()))
    chunk = take(batch, rows)
    packed, decoder = pack(chunk.input_ids, chunk.attention_mask), module.policy.get_decoder()

    def per_row():
        with packed_attention(module.policy):
            decoder(**packed.model_kwargs()).last_hidden_state.sum().backward()

    def block_mask():  # transformers detects the restarting positions and builds an [R, R] mask
        decoder(input_ids=packed.input_ids, position_ids=packed.position_ids).last_hidden_state.sum().backward()

    times: dict[str, list[float]] = {"per-row SDPA": [], "block-diagonal mask": []}
    for i in range(a.repeats + 1):
        for name, fn in (("per-row SDPA", per_row), ("block-diagonal mask", block_mask)):
            module.policy.zero_grad()
            start = clocks()
            fn()
            if i:
                times[name].append(since(start)[1])
    real = int(chunk.attention_mask.sum())
    return [{"attention": name, "rows": len(rows), "real_tokens": real, "cpu_s": statistics.median(t)}
            for name, t in times.items()]


def child(a: argparse.Namespace) -> dict:
    import torch

    from bench.oom_acceptance import batch_of

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the machine is shared: one thread keeps CPU time proportional to work done
    batches = [batch_of(lengths_of(a, seed), a.vocab) for seed in range(a.repeats + 1)]
    modules = {arm: build(a, arm) for arm in ARMS}
    times: dict[str, list[tuple[float, float]]] = {arm: [] for arm in ARMS}
    tokens: dict[str, list[int]] = {arm: [] for arm in ARMS}
    chunks: dict[str, list[int]] = {arm: [] for arm in ARMS}
    for i, batch in enumerate(batches):
        for arm, module in modules.items():  # interleaved: every round runs every arm
            start = clocks()
            module.updater.update(batch)
            if i:  # the first batch warms up allocator and kernels
                times[arm].append(since(start))
                plan = module.updater.last_plan
                tokens[arm].append(plan_tokens(batch, plan, arm == "packed"))
                chunks[arm].append(plan.real_chunks)
    params = sum(p.numel() for p in modules["packed"].policy.parameters())
    real = statistics.median(int(b.attention_mask.sum()) for b in batches[1:])
    out = []
    for arm in ARMS:
        flops = flops_of(modules[arm], batches[1])
        out.append({"arm": arm, "chunks": statistics.median(chunks[arm]), "tokens": statistics.median(tokens[arm]),
                    "wall_s": statistics.median(t[0] for t in times[arm]),
                    "cpu_s": statistics.median(t[1] for t in times[arm]), "gflops": flops / 1e9,
                    "flops_per_6nd": flops / (6 * params * int(batches[1].attention_mask.sum()))})
    return {"results": out, "attention": attention_rows(a, modules["packed"], batches[1]), "real_tokens": real,
            "params": params}


def memory_child(a: argparse.Namespace, arm: str) -> dict:
    import torch

    from bench.oom_acceptance import batch_of
    from bench.update_memory import _reset_peak, _status_mb

    torch.manual_seed(0)
    torch.set_num_threads(1)
    module, batch = build(a, arm), batch_of(lengths_of(a, 1), a.vocab)
    module.updater.update(batch_of(lengths_of(a, 0), a.vocab))  # warm: optimizer state and allocator exist
    base, reset = _status_mb("VmRSS"), _reset_peak()
    module.updater.update(batch)
    return {"arm": arm, "update_peak_mb": (_status_mb("VmHWM") - base) if reset else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--memory", choices=ARMS)
    ap.add_argument("--rows", type=int)
    ap.add_argument("--median", type=int)
    ap.add_argument("--tail-factor", type=int, default=8)
    ap.add_argument("--tail-share", type=float, default=0.1)
    ap.add_argument("--budget", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    a.rows = a.rows or (32 if a.quick else 64)
    a.median = a.median or (32 if a.quick else 64)
    a.budget = a.budget or (2048 if a.quick else 4096)
    # Full run: the ~30M Qwen2 of bench/speed_vs_trl.py (the matched workload); quick: a 1.5M one.
    shape = (8192, 128, 2, 4, 2, 512) if a.quick else (32768, 512, 4, 8, 2, 1792)
    a.vocab, a.hidden, a.layers = a.vocab or shape[0], a.hidden or shape[1], a.layers or shape[2]
    a.heads, a.kv_heads, a.intermediate = shape[3:]
    if a.child or a.memory:
        print(json.dumps(memory_child(a, a.memory) if a.memory else child(a)))
        return
    args = ["--rows", str(a.rows), "--median", str(a.median), "--tail-factor", str(a.tail_factor), "--tail-share",
            str(a.tail_share), "--budget", str(a.budget), "--vocab", str(a.vocab), "--hidden", str(a.hidden),
            "--layers", str(a.layers), "--repeats", str(a.repeats), *(["--quick"] if a.quick else [])]
    load = [load_average()]
    d = run_child("bench.packing", "--child", *args)
    memory = {arm: run_child("bench.packing", "--memory", arm, *args)["update_peak_mb"] for arm in ARMS}
    load.append(load_average())
    for r in d["results"]:
        r["update_peak_mb"] = memory[r["arm"]]
    by = {r["arm"]: r for r in d["results"]}
    ratio = {f"{base}/packed {k}": by[base][k] / by["packed"][k] for base in ("padded", "fixed")
             for k in ("cpu_s", "wall_s", "tokens")}
    print(f"packed vs padded chunks: {a.rows} sequences, completions ~{a.median} tokens with {a.tail_share:.0%} at "
          f"{a.tail_factor}x, prompt {PROMPT}, budget {a.budget} tokens, hidden {a.hidden} x {a.layers} layers, vocab "
          f"{a.vocab} ({d['params'] / 1e6:.1f}M params); {d['real_tokens']} real tokens a batch; load average "
          f"{min(load):.1f}-{max(load):.1f}")
    print(table(d["results"], ["arm", "chunks", "tokens", "gflops", "flops_per_6nd", "cpu_s", "wall_s",
                               "update_peak_mb"]))
    print(table(d["attention"], ["attention", "rows", "real_tokens", "cpu_s"]))
    print("\n" + ", ".join(f"{k}: {v:.2f}x" for k, v in ratio.items()))
    path = save("packing", {**d, "rows": a.rows, "median": a.median, "tail_factor": a.tail_factor,
                            "tail_share": a.tail_share, "budget": a.budget, "vocab": a.vocab, "hidden": a.hidden,
                            "layers": a.layers, "prompt": PROMPT, "repeats": a.repeats, "ratio": ratio,
                            "load_average": load, "command": " ".join(["python -m bench.packing", *sys.argv[1:]])})
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
