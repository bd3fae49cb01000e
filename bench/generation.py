"""Transformers-engine generation against its matmul floors and against the peers' generate calls (issue 32).

    .venv/bin/python -m bench.generation                 # batches 8/32/128, 3 interleaved rounds
    .venv/bin/python -m bench.generation --compile       # + static KV cache with a compiled decode step
    .venv/bin/python -m bench.generation --quick         # batch 8, 1 round (smoke)

The speed bench's ~30M Qwen2 policy (grouped-query: 8 query heads, 2 KV heads), 4 prompts x group (batch = 4 x
group) x 64 new tokens at temperature 1, float32, one thread, one process. Per round every variant draws every batch
once, variants in turn (interleaved: machine load hits all alike); CPU seconds, medians over rounds:

- ``ours``: ``HFEngine`` as shipped (grouped-query decoding without KV copies, ``rollout/gqa.py``).
- ``ours-kv-copies``: the same engine on transformers' ``sdpa`` path (``grouped_attention=False``): the engine before.
- ``trl-generate``: the call TRL 1.16's ``GRPOTrainer`` makes without vLLM (trl/trainer/grpo_trainer.py:
  ``GenerationConfig(do_sample=True, top_k=0, top_p=1, temperature=1, min_p=None, repetition_penalty=1,
  cache_implementation=None, disable_compile=True)``, transformers' ``multinomial`` sampler), same prompts.
- ``plain-generate``: ``model.generate(do_sample=True)`` with transformers' defaults (``top_k=50``).
- ``ours-static-compiled`` (``--compile``): ours with ``cache_implementation="static"`` and the decode step
  compiled (``CompileConfig(fullgraph=True)`` on all devices); its first draw per batch (the compile) is timed apart.

Floors, per batch: *gemm floor* = the forward's matmuls (every linear layer, the LM head on completion tokens only)
at the rate they reach with all tokens in one GEMM (M = batch x sequence), the issue's "GEMM floor"; *decode-shape
floor* = the same matmuls at the shapes decoding must run them (a prefill of the prompts, then one GEMM of M = batch
rows per layer per new token), each timed bare. The gap between the two is what decoding one token at a time costs
before any attention, sampling or framework work.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.nn import functional as F

from bench.common import save, table

PROMPTS, NEW_TOKENS = 4, 64
GROUPS = {8: 2, 32: 8, 128: 32}  # batch -> group size


def linear_shapes(config) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's linear layers."""
    h, inter = config.hidden_size, config.intermediate_size
    kv = h * config.num_key_value_heads // config.num_attention_heads
    return [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter)]


def _matmul_s(shapes: list[tuple[int, int, int]], repeats: int = 3) -> float:
    """CPU seconds of ``F.linear`` at each (M, out, in), median of ``repeats``, summed."""
    total = 0.0
    for m, out, inp in shapes:
        x, w = torch.randn(m, inp), torch.randn(out, inp)
        F.linear(x, w)  # warm-up
        times = []
        for _ in range(repeats):
            c = time.process_time()
            F.linear(x, w)
            times.append(time.process_time() - c)
        total += statistics.median(times)
    return total


def floors(config, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """The two matmul floors of drawing ``new_tokens`` for ``batch`` rows of ``prompt_len`` prompt tokens."""
    layer, head = linear_shapes(config), (config.vocab_size, config.hidden_size)
    body = lambda m: [(m, o, i) for o, i in layer] * config.num_hidden_layers
    whole = _matmul_s(body(batch * (prompt_len + new_tokens)) + [(batch * new_tokens, *head)])
    prefill = _matmul_s(body(batch * prompt_len) + [(batch, *head)])
    step = _matmul_s(body(batch) + [(batch, *head)], repeats=5)
    flops = 2 * batch * (prompt_len + new_tokens) * sum(o * i for o, i in layer) * config.num_hidden_layers
    flops += 2 * batch * new_tokens * head[0] * head[1]
    return {"gemm_floor_s": whole, "decode_floor_s": prefill + (new_tokens - 1) * step, "gflop": flops / 1e9}


def _variants(model, tok, compile_decode: bool) -> dict:
    from transformers import CompileConfig, GenerationConfig

    from lightning_grpo.rollout.base import SamplingConfig
    from lightning_grpo.rollout.hf import HFEngine

    ours, copies = HFEngine(model, tok), HFEngine(model, tok, grouped_attention=False)
    sampling = lambda seed: SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=seed)
    trl = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=True, pad_token_id=tok.pad_token_id,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, temperature=1.0, top_p=1.0,
                           top_k=0, min_p=None, repetition_penalty=1.0, cache_implementation=None,
                           disable_compile=True)

    def hf_generate(config):
        def draw(prompts, group, seed):
            ids, mask = ours._left_pad([p.token_ids for p in prompts for _ in range(group)])
            torch.manual_seed(seed)
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            return int((out[:, ids.shape[1]:] != tok.pad_token_id).sum())
        return draw

    def engine(e):
        return lambda prompts, group, seed: sum(len(r.token_ids) for r in e.generate(prompts, group, sampling(seed)))

    out = {"ours": engine(ours), "ours-kv-copies": engine(copies), "trl-generate": hf_generate(trl),
           "plain-generate": hf_generate(GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=True,
                                                          pad_token_id=tok.pad_token_id))}
    if compile_decode:
        static = HFEngine(model, tok)
        base = static._generation_config

        def compiled(s):
            config = base(s)
            config.cache_implementation = "static"
            config.compile_config = CompileConfig(fullgraph=True, dynamic=False)
            config.compile_config._compile_all_devices = True  # transformers compiles on CUDA only otherwise
            return config

        static._generation_config = compiled
        out["ours-static-compiled"] = engine(static)
    return out


def measure(batches: list[int], rounds: int, compile_decode: bool) -> dict:
    from bench.speed_vs_trl import policy_dir, prompt_rows
    from lightning_grpo.policy import PolicyConfig, load_policy
    from lightning_grpo.rollout.base import Prompt

    torch.set_num_threads(1)
    model, tok = load_policy(PolicyConfig(path=str(policy_dir())))
    prompts = [Prompt(i, tok(r["prompt"])["input_ids"], r["prompt"], r["answer"])
               for i, r in enumerate(prompt_rows(PROMPTS))]
    variants = _variants(model, tok, compile_decode)
    first: dict[str, float] = {}
    for name, draw in variants.items():  # warm-up (and the compile, timed on its own)
        for b in batches:
            c = time.process_time()
            w = time.perf_counter()
            draw(prompts, GROUPS[b], 0)
            first[f"{name}/{b}"] = time.perf_counter() - w if name.endswith("compiled") else time.process_time() - c
    cpu: dict[tuple[str, int], list[float]] = {}
    tokens: dict[tuple[str, int], int] = {}
    for r in range(rounds):
        for b in batches:
            for name, draw in variants.items():
                c = time.process_time()
                tokens[name, b] = draw(prompts, GROUPS[b], r + 1)
                cpu.setdefault((name, b), []).append(time.process_time() - c)
        print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    prompt_len = max(len(p.token_ids) for p in prompts)
    floor = {b: floors(model.config, b, prompt_len, NEW_TOKENS) for b in batches}
    rows = []
    for (name, b), secs in cpu.items():
        s = statistics.median(secs)
        rows.append({"variant": name, "batch": b, "tokens": tokens[name, b], "cpu_s": s, "min_s": min(secs),
                     "max_s": max(secs), "x_gemm_floor": s / floor[b]["gemm_floor_s"],
                     "x_decode_floor": s / floor[b]["decode_floor_s"]})
    return {"rows": rows, "floors": [{"batch": b, **f} for b, f in floor.items()], "first_draw_s": first,
            "prompt_len": prompt_len}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="add the static-cache compiled-decode variant")
    ap.add_argument("--quick", action="store_true", help="batch 8, one round")
    a = ap.parse_args()
    batches, rounds = ([8], 1) if a.quick else (list(GROUPS), a.rounds)
    start = time.perf_counter()
    d = measure(batches, rounds, a.compile)
    ours = {r["batch"]: r["cpu_s"] for r in d["rows"] if r["variant"] == "ours"}
    for r in d["rows"]:
        r["x_ours"] = r["cpu_s"] / ours[r["batch"]]
    d["rows"].sort(key=lambda r: (r["batch"], r["cpu_s"]))
    print(table(d["rows"], ["variant", "batch", "tokens", "cpu_s", "min_s", "max_s", "x_ours", "x_gemm_floor",
                            "x_decode_floor"]))
    print(table(d["floors"], ["batch", "gflop", "gemm_floor_s", "decode_floor_s"]))
    args = " ".join(sys.argv[1:])
    save("generation", {**d, "command": f"python -m bench.generation {args}".strip(), "rounds": rounds,
                        "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "wall_s": time.perf_counter() - start})


def section(d: dict | None, md_table, load_range) -> str:
    """The docs/benchmarks.md section (rendered by bench/report.py)."""
    title = "## 4b. Generation against its matmul floors, and the peers' generate calls"
    if not d:
        return f"{title}\n\nNot run."
    first = d.get("first_draw_s", {})
    compile_s = [v for k, v in first.items() if k.startswith("ours-static-compiled")]
    return "\n".join([
        title,
        "",
        (f"`{d['command']}`: the speed bench's ~30M Qwen2 policy (8 query heads, 2 KV heads), {d['prompts']} prompts "
         f"x group x {d['new_tokens']} new tokens at temperature 1, float32, one thread, one process; per round every "
         f"variant draws every batch in turn, {d['rounds']} rounds, CPU seconds (median, min-max). *ours*: the "
         "transformers engine as shipped (grouped-query decoding without KV-head copies, `rollout/gqa.py`); "
         "*ours-kv-copies*: the same on transformers' `sdpa` path (the engine before); *trl-generate*: the "
         "`generate` call TRL 1.16 makes without vLLM (`do_sample=True, top_k=0`, transformers' multinomial "
         "sampler); *plain-generate*: `generate(do_sample=True)` with transformers' defaults (`top_k=50`); "
         "*ours-static-compiled*: ours with a static KV cache and a compiled decode step"
         + (f" (its first draw, the compile, took {max(compile_s):.0f} s wall)" if compile_s else "") + "."
         + load_range(d)),
        "",
        md_table(d["rows"], [("variant", "variant"), ("batch", "batch"), ("tokens", "tokens"), ("cpu_s", "CPU s"),
                             ("min_s", "min"), ("max_s", "max"), ("x_ours", "x ours"),
                             ("x_gemm_floor", "x GEMM floor"), ("x_decode_floor", "x decode-shape floor")]),
        "",
        ("Floors: *GEMM floor* = the forward's matmuls (every linear layer; the LM head on completion tokens only) at "
         "the rate they reach as one GEMM over all tokens; *decode-shape floor* = the same matmuls at the shapes "
         "decoding runs them (the prompts' prefill, then M = batch rows per layer per new token), each timed bare."),
        "",
        md_table(d["floors"], [("batch", "batch"), ("gflop", "GFLOP"), ("gemm_floor_s", "GEMM floor s"),
                               ("decode_floor_s", "decode-shape floor s")]),
        "",
        *_reading(d),
    ])


def _reading(d: dict) -> list[str]:
    """What the tables say, from their own figures (batch 32: the issue's reference point)."""
    row = {(r["variant"], r["batch"]): r for r in d["rows"]}
    floor = {f["batch"]: f for f in d["floors"]}
    if ("ours", 32) not in row or 32 not in floor:
        return []
    ours, f = row["ours", 32], floor[32]
    lines = [
        (f"At batch 32 the transformers engine takes {ours['x_gemm_floor']:.2f}x the GEMM floor: the matmuls alone, "
         f"at the shapes decoding runs them, already take {f['decode_floor_s'] / f['gemm_floor_s']:.2f}x it (a "
         "32-row GEMM streams every weight once per token and runs at about half the rate of a large one on this "
         "CPU), so the issue's <= 1.3x is out of reach for any decoder that draws one token per step here; the "
         f"engine takes {ours['x_decode_floor']:.2f}x those matmuls (attention, sampler, `generate`)."),
    ]
    if ("trl-generate", 32) in row:
        trl, plain = row["trl-generate", 32], row.get(("plain-generate", 32))
        lines += ["", (f"TRL's `generate` call is {trl['x_ours']:.2f}x ours at batch 32, measured side by side in "
                       "one process on the same prompts: it samples with `torch.multinomial` (one exponential draw "
                       "per vocabulary entry per row per step) where ours draws by inverse CDF (one uniform per row), "
                       "and it copies the grouped KV heads at every step."
                       + (f" Plain `generate(do_sample=True)` is slower still ({plain['x_ours']:.2f}x) only because "
                          "of transformers' default `top_k=50` (a top-k over the vocabulary every step), which TRL "
                          "turns off (`top_k=0`)." if plain else ""))]
    if ("ours-static-compiled", 32) in row:
        static = row["ours-static-compiled", 32]
        lines += ["", (f"A static KV cache with a compiled decode step is {1 / static['x_ours']:.2f}x faster than "
                       "ours once compiled, with the same tokens; it is not the default: the compile costs tens of "
                       "seconds per batch shape, and the static cache's length (prompt width + max_new_tokens) "
                       "changes with every collected batch's longest prompt, and each new length compiles again "
                       "(`dynamic=False`).")]
    return lines


if __name__ == "__main__":
    main()
