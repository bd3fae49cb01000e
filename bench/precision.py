"""Precision on CPU: bf16 autocast vs fp32 (speed, gradient error), fused vs foreach AdamW, bf16 weights' lost updates.

    .venv/bin/python -m bench.precision            # ~5 min on 2 busy cores
    .venv/bin/python -m bench.precision --quick    # smaller batch, fewer rounds

1. **The update under bf16 autocast** (what ``precision: bf16-mixed`` runs: fp32 weights, Lightning's
   ``torch.autocast("cpu", torch.bfloat16, cache_enabled=False)``) against fp32: one GRPO forward/backward
   (``GRPOModule.forward_chunk``) on a fixed collected batch, timed in interleaved A/B rounds in one process;
   the gradient error of the bf16 run against the fp32 one.
   The same on the quickstart's tiny policy (hidden 128, its 64 x 8-token batches), natively.
2. **The same on a CPU without native bf16**, emulated in child processes that hide the CPU's instructions from
   oneDNN and ATen: ``ONEDNN_MAX_CPU_ISA=AVX512_CORE`` (AVX-512 without BF16: bf16 converted in oneDNN) and
   ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` (no AVX-512 at all: ATen's scalar bf16 fallback).
   Each child times fp32 and bf16 side by side; the slowdown is what the warning at fit start is about.
3. **AdamW's step**: fused vs foreach vs the for-loop (torch's CPU default before), same parameters.
4. **Lost updates**: the share of weights 4 AdamW steps at lr 1e-6 change, bf16 weights vs fp32 weights.

One thread everywhere (``--threads``), so the ratios do not depend on how busy the other cores are.
Writes bench/results/precision.json; docs/precision.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench.common import cpu_model, load_average, run_child, save, table

SPEC = {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 1408,
        "vocab_size": 8192, "max_position_embeddings": 256}
QUICKSTART = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256,
              "vocab_size": None, "max_position_embeddings": 256}
"""The quickstart's tiny policy (char vocabulary), timed on its own collected batch shape: 64 x up to 8 tokens."""
EMULATED = {  # name -> environment hiding the CPU's bf16 instructions
    "avx512-no-bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return sorted(f for f in flags if "bf16" in f or "fp16" in f or f in ("avx2", "avx512f", "amx_tile"))


def setup(rows: int, completion: int, spec: dict = SPEC):
    """(module, batch): the bench policy (built once, cached) and a fixed batch of unequal completion lengths."""
    import torch

    from lightning_grpo.batch import RolloutBatch
    from lightning_grpo.config import GRPOConfig
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.tiny.spec import TinyPolicySpec

    module = GRPOModule(policy=PolicyConfig(path="tiny:bench-precision", tiny=TinyPolicySpec(**spec)),
                        rl=GRPOConfig(batch_per_replica=rows, group_size=rows // 2))
    module.configure_model()  # no Trainer: build the policy ourselves
    vocab = module.policy.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt, lens = 16, torch.randint(completion // 2, completion + 1, (rows,), generator=g)
    width = prompt + completion
    attn = torch.arange(width) < (prompt + lens).unsqueeze(-1)  # [N, T]
    comp = attn & (torch.arange(width) >= prompt)
    batch = RolloutBatch(input_ids=torch.randint(4, vocab, (rows, width), generator=g).masked_fill(~attn, 0),
                         attention_mask=attn, completion_mask=comp, advantages=torch.randn(rows, generator=g),
                         rewards=torch.rand(rows, generator=g), group_ids=torch.arange(rows) // 2,
                         sample_ids=torch.arange(rows))
    return module, batch


def update(module, batch, bf16: bool) -> tuple:
    """(seconds, flat fp64 gradient tensor) of one GRPO forward/backward, under bf16 autocast as Lightning runs it."""
    import torch

    module.policy.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16, cache_enabled=False):
        loss, _, _ = module.forward_chunk(batch, None)
    loss.backward()
    seconds = time.perf_counter() - start
    return seconds, torch.cat([p.grad.double().flatten() for p in module.policy.parameters()])


def child_update(rows: int, completion: int, rounds: int, spec: dict = SPEC) -> dict:
    """fp32 and bf16 autocast updates in interleaved rounds (A/B/A/B), and the bf16 gradient's error."""
    import torch

    module, batch = setup(rows, completion, spec)
    update(module, batch, False), update(module, batch, True)  # warm-up: oneDNN picks its kernels
    fp32, bf16 = [], []
    for _ in range(rounds):
        t, ref = update(module, batch, False)
        fp32.append(t)
        t, grad = update(module, batch, True)
        bf16.append(t)
    err = grad - ref
    ratios = [b / f for b, f in zip(bf16, fp32)]
    return {"fp32_s": statistics.median(fp32), "bf16_s": statistics.median(bf16),
            "bf16_over_fp32": statistics.median(ratios), "ratio_spread": [min(ratios), max(ratios)],
            "grad_max_rel": float(err.abs().max() / ref.abs().max()), "grad_l2_rel": float(err.norm() / ref.norm()),
            "grad_cosine": float(torch.nn.functional.cosine_similarity(grad, ref, dim=0)),
            "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "native")}


def adamw_steps(rounds: int) -> dict:
    """Seconds of one AdamW step on the bench policy's parameters: fused, foreach, for-loop (interleaved rounds)."""
    import torch

    module, _ = setup(4, 8)
    params = list(module.policy.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    kinds = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    opts = {k: torch.optim.AdamW(params, lr=1e-6, weight_decay=0.01, **kw) for k, kw in kinds.items()}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds + 1):
        for k, opt in opts.items():
            start = time.perf_counter()
            opt.step()
            if r:  # round 0 warms up (state allocation)
                times[k].append(time.perf_counter() - start)
    out = {f"{k}_s": statistics.median(v) for k, v in times.items()}
    out["params"] = sum(p.numel() for p in params)
    out["foreach_over_fused"] = out["foreach_s"] / out["fused_s"]
    out["forloop_over_fused"] = out["for-loop_s"] / out["fused_s"]
    return out


def lost_updates(rows: int, completion: int) -> dict:
    """Share of weights 4 AdamW steps at lr 1e-6 change, with fp32 and with bf16 weights (same batch)."""
    import torch

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        module, batch = setup(rows, completion)
        module.policy.to(dtype)
        before = [p.detach().clone() for p in module.policy.parameters()]
        loop = module.updater.attach(torch.optim.AdamW(module.policy.parameters(), lr=1e-6))
        for _ in range(4):
            loop.accumulator.train(*module.forward_chunk(batch, None)[:2])
        changed = sum(int((p.detach() != b).sum()) for p, b in zip(module.policy.parameters(), before))
        out[str(dtype).removeprefix("torch.")] = changed / sum(b.numel() for b in before)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", choices=["update"], help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=0)
    ap.add_argument("--completion", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--quickstart-policy", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    if a.child:
        print(json.dumps(child_update(a.rows, a.completion, a.rounds, QUICKSTART if a.quickstart_policy else SPEC)))
        return
    rows, completion, rounds = (8, 48, 2) if a.quick else (16, 96, 3)
    args = ["--rows", str(rows), "--completion", str(completion), "--threads", str(a.threads)]
    load0 = load_average()
    native = run_child("bench.precision", "--child", "update", *args, "--rounds", str(rounds))
    emulated = {name: run_child("bench.precision", "--child", "update", *args, "--rounds", "1",
                                env={**os.environ, **env}) for name, env in EMULATED.items()}
    quickstart = run_child("bench.precision", "--child", "update", "--rows", "64", "--completion", "8", "--threads",
                           str(a.threads), "--rounds", str(rounds + 2), "--quickstart-policy")
    adamw = adamw_steps(5 if a.quick else 10)
    lost = lost_updates(rows, completion)
    rows_out = [{"CPU bf16": "native (this CPU)", **_row(native)}]
    rows_out += [{"CPU bf16": f"emulated: {name}", **_row(r)} for name, r in emulated.items()]
    rows_out += [{"CPU bf16": "native, quickstart policy", **_row(quickstart)}]
    print(f"bf16 autocast vs fp32, one GRPO forward/backward: {rows} sequences x up to {completion} completion "
          f"tokens, Qwen2 hidden {SPEC['hidden_size']} x {SPEC['num_layers']} layers, vocab {SPEC['vocab_size']}, "
          f"{a.threads} thread(s); {cpu_model()} ({', '.join(cpu_flags())})")
    print(table(rows_out, ["CPU bf16", "fp32 s", "bf16 s", "bf16/fp32", "grad max rel err", "grad cosine"]))
    print(f"\nAdamW step, {adamw['params'] / 1e6:.1f}M parameters: fused {adamw['fused_s'] * 1e3:.1f} ms, foreach "
          f"{adamw['foreach_s'] * 1e3:.1f} ms ({adamw['foreach_over_fused']:.2f}x fused), for-loop "
          f"{adamw['for-loop_s'] * 1e3:.1f} ms ({adamw['forloop_over_fused']:.2f}x fused)")
    print(f"weights changed by 4 AdamW steps at lr 1e-6: float32 {lost['float32']:.1%}, bfloat16 {lost['bfloat16']:.1%}")
    path = save("precision", {"command": "python -m bench.precision" + (" --quick" * a.quick), "rows": rows,
                              "completion": completion, "rounds": rounds, "policy": SPEC, "threads": a.threads,
                              "cpu_flags": cpu_flags(), "load_before": load0, "load_after": load_average(),
                              "update": {"native": native, **emulated, "quickstart_policy": quickstart},
                              "adamw": adamw, "lost_updates": lost})
    print(f"\nwrote {path}")


def _row(r: dict) -> dict:
    return {"fp32 s": r["fp32_s"], "bf16 s": r["bf16_s"], "bf16/fp32": r["bf16_over_fp32"],
            "grad max rel err": f"{r['grad_max_rel']:.1e}", "grad cosine": f"{r['grad_cosine']:.6f}"}


if __name__ == "__main__":
    sys.exit(main())
