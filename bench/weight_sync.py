"""Weight-sync time into the real vLLM engine: bucketed vs per-layer vs per-parameter pushes.

    .venv/bin/python -m bench.weight_sync              # 16 layers, hidden 64: ~200 small tensors
    .venv/bin/python -m bench.weight_sync --quick      # 8 layers, 3 repeats

Each ``load_weights`` call is one vLLM in-place reload (fixed cost: re-wrapping every layer's
loaders, finalizing every layer), so many small tensors make per-call overhead dominate.
Modes, all through ``push_weights`` into one engine built once (CPU build on this machine):

- bucketed: the default 256 MiB buckets (the whole tiny model in one call);
- per-layer: one call per load group (a decoder layer), the finest split vLLM reloads correctly;
- per-parameter: one call per tensor (``group_key=None``). vLLM 0.32 rebuilds a fused layer
  (qkv_proj, gate_up_proj) that receives only some of its inputs from uninitialized memory,
  so this mode is also *wrong*; the ``max_abs_logprob_err`` column shows it.

Modes alternate within each repeat so machine load hits all alike; the median is reported.
After each mode's last push the engine's prompt logprobs of a fixed sequence are compared
with the trainer's (float32 both).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from bench.common import save, table

MODES = {
    "bucketed": {},
    "per-layer": {"bucket_bytes": 1},
    "per-parameter": {"bucket_bytes": 1, "group_key": None},
}
SEQUENCE = "(12+34)*56-78=90; 3*3*3=27"


def build(layers: int, hidden: int, folder: str):
    from lightning_grpo.policy import PolicyConfig, load_policy
    from lightning_grpo.rollout.vllm import VLLMConfig, VLLMEngine
    from lightning_grpo.tiny.build import build_tiny_policy
    from lightning_grpo.tiny.spec import TinyPolicySpec

    spec = TinyPolicySpec(
        hidden_size=hidden, num_layers=layers, num_heads=hidden // 32, num_kv_heads=1, intermediate_size=2 * hidden
    )
    path = build_tiny_policy(folder, spec)
    model, tok = load_policy(PolicyConfig(path=str(path)))
    start = time.perf_counter()
    engine = VLLMEngine(
        path, VLLMConfig(dtype="float32", enforce_eager=True, max_model_len=128, kv_cache_memory_bytes=16 << 20)
    )
    return model, tok, engine, time.perf_counter() - start


def logprob_error(model, engine, ids: list[int]) -> float:
    """max |engine - trainer| over the sequence's token logprobs (prompt_logprobs: no prefix cache involved)."""
    from vllm import SamplingParams

    out = engine.llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    served = torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:])])
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    return float((served - lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]).abs().max())


def measure(model, engine, ids: list[int], repeats: int) -> list[dict]:
    from lightning_grpo.rollout.weight_sync import push_weights

    times: dict[str, list[float]] = {m: [] for m in MODES}
    stats, errors = {}, {}
    for _ in range(repeats):
        for mode, kwargs in MODES.items():
            with torch.no_grad():  # a fresh update each push, so every push moves real values
                for p in model.parameters():
                    p.mul_(1.001)
            stats[mode] = push_weights(model, engine, **kwargs)
            times[mode].append(stats[mode].seconds)
            errors[mode] = logprob_error(model, engine, ids)
    base = statistics.median(times["bucketed"])
    return [
        {
            "mode": m,
            "calls": stats[m].n_buckets,
            "tensors": stats[m].n_tensors,
            "MiB": stats[m].bytes / 2**20,
            "median_ms": 1e3 * statistics.median(times[m]),
            "x_bucketed": statistics.median(times[m]) / base,
            "max_abs_logprob_err": errors[m],
        }
        for m in MODES
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="8 layers, 3 repeats")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.repeats = 8, 3
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with tempfile.TemporaryDirectory() as folder:
        model, tok, engine, build_s = build(args.layers, args.hidden, folder)
        rows = measure(model, engine, tok(SEQUENCE)["input_ids"], args.repeats)
        engine.close()
    import vllm

    print(table(rows, list(rows[0])))
    ratio = rows[2]["x_bucketed"]
    print(
        f"\nper-parameter / bucketed = {ratio:.1f}x  ({rows[2]['calls']} calls vs {rows[0]['calls']});"
        f" engine build {build_s:.1f} s"
    )
    path = save(
        "weight_sync",
        {
            "layers": args.layers,
            "hidden": args.hidden,
            "repeats": args.repeats,
            "vllm": vllm.__version__,
            "engine_build_s": build_s,
            "rows": rows,
            "per_parameter_over_bucketed": ratio,
        },
    )
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
