"""Token logprobs of one forward+backward: the fused head vs the v1 sliced path vs plain full logits.

    .venv/bin/python -m bench.logprobs            # both shapes: 32 x 64 and 4 x 2048 completion tokens
    .venv/bin/python -m bench.logprobs --rounds 1 # a quick look

Four ways to get ``[B, T-1]`` logprobs of the completion tokens with gradients, then ``backward``:

* ``plain``: ``log_softmax(model(x).logits / T)`` gathered: the textbook path (full ``[B, T, V]`` logits).
* ``sliced``: lightning-grpo v1 (before issue 22): the LM head over every position in 128-token slices,
  each slice checkpointed (its logits recomputed in backward). Kept here verbatim as the baseline.
* ``fused``: ``lightning_grpo.logprobs.token_logprobs``: the head only at completion positions, chunked,
  the softmax gradient formed in place (logits kept from forward up to ``KEEP_BYTES``, the default
  ``rl.logits_keep_mb``; past it the head is recomputed in backward).
* ``fused-keep0``: the same with ``rl.logits_keep_mb=0``: every chunk recomputed (the least memory).

Shapes: ``64``: the speed bench's workload (32 completions x 64 tokens after a short prompt, the ~30M Qwen2
policy, vocabulary 32768); ``2048``: long completions (4 x 2048 tokens after a 16-token prompt, the same head
on a 1-layer body so one repeat stays in seconds; the head is what differs between the paths).
Time: CPU seconds of forward+backward, one thread, the three paths interleaved in one process (A/B/C rounds),
median and range. Memory: in a fresh process per path, the peak RSS reached during one forward+backward minus
the RSS before it (``/proc/self/clear_refs`` resets the kernel's high-water mark). Equality: the fused
logprobs and every parameter gradient against ``plain``, as max |diff| / max |plain|.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench.common import load_average, pyplot, run_child, save, table

PATHS = ("plain", "sliced", "fused", "fused-keep0")
SHAPES = {
    "64": {"rows": 32, "prompt": 4, "completion": 64, "layers": 4},
    "2048": {"rows": 4, "prompt": 16, "completion": 2048, "layers": 1},
}
POLICY = {"hidden_size": 512, "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 1792, "vocab_size": 32768}


# -- the three paths ---------------------------------------------------------------------------------------------
def sliced_v1(model, input_ids, attention_mask, temperature: float = 1.0, slice_tokens: int = 128):
    """lightning-grpo v1's ``token_logprobs`` (all positions, checkpointed 128-token slices), verbatim."""
    import torch
    from torch.utils.checkpoint import checkpoint

    def one(head, hidden, targets, temperature):
        logits = head(hidden)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)

    targets = input_ids[:, 1:]
    head = model.get_output_embeddings()
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
    out = []
    for start in range(0, hidden.shape[1], slice_tokens):
        h, t = hidden[:, start : start + slice_tokens], targets[:, start : start + slice_tokens]
        out.append(checkpoint(one, head, h, t, temperature, use_reentrant=False))
    return torch.cat(out, dim=1)


def score(path: str, model, ids, attn, positions):
    import torch

    from lightning_grpo.fused_head import KEEP_BYTES
    from lightning_grpo.logprobs import token_logprobs

    if path.startswith("fused"):
        keep = 0 if path == "fused-keep0" else KEEP_BYTES
        return token_logprobs(model, ids, attn, positions=positions, keep_bytes=keep)
    if path == "sliced":
        return sliced_v1(model, ids, attn) * positions
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()  # [B, T-1, V]
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0] * positions


def setup(shape: str):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    s = SHAPES[shape]
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=POLICY["vocab_size"], hidden_size=POLICY["hidden_size"],
                         intermediate_size=POLICY["intermediate_size"], num_hidden_layers=s["layers"],
                         num_attention_heads=POLICY["num_heads"], num_key_value_heads=POLICY["num_kv_heads"],
                         max_position_embeddings=s["prompt"] + s["completion"] + 8, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config).train()
    width = s["prompt"] + s["completion"]
    ids = torch.randint(4, POLICY["vocab_size"], (s["rows"], width))
    attn = torch.ones_like(ids, dtype=torch.bool)
    positions = (torch.arange(width) >= s["prompt"])[None, 1:].expand(s["rows"], -1)  # the completion mask, shifted
    weights = torch.randn(positions.shape)  # an arbitrary upstream gradient per token
    return model, ids, attn, positions, weights


def step(path: str, model, ids, attn, positions, weights):
    model.zero_grad(set_to_none=True)
    lp = score(path, model, ids, attn, positions)
    (lp * weights).sum().backward()
    return lp


# -- children ------------------------------------------------------------------------------------------------------
def memory_child(shape: str, path: str) -> dict:
    import torch

    from bench.update_memory import _reset_peak, _status_mb

    torch.set_num_threads(1)
    model, ids, attn, positions, weights = setup(shape)
    step(path, model, ids, attn, positions, weights)  # warm-up: gradients allocated, allocator settled
    model.zero_grad(set_to_none=False)
    base, reset = _status_mb("VmRSS"), _reset_peak()
    step(path, model, ids, attn, positions, weights)
    return {"shape": shape, "path": path, "peak_mb": _status_mb("VmHWM") - base if reset else None}


def time_child(shape: str, rounds: int) -> dict:
    import torch

    torch.set_num_threads(1)
    model, ids, attn, positions, weights = setup(shape)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    grads, values = {}, {}
    for r in range(rounds + 1):  # round 0 is warm-up
        for path in PATHS if r % 2 else reversed(PATHS):  # A/B/C, C/B/A: neither order favours a path
            c0 = time.process_time()
            lp = step(path, model, ids, attn, positions, weights)
            if r:
                times[path].append(time.process_time() - c0)
            else:
                values[path] = lp.detach()
                grads[path] = {n: p.grad.clone() for n, p in model.named_parameters()}
    rel = {path: max(_rel(values[path], values["plain"]),
                     *(_rel(grads[path][n], grads["plain"][n]) for n in grads["plain"])) for path in PATHS}
    return {"shape": shape, "times": times, "max_rel_diff": rel,
            "tokens": int(positions.sum()), "positions": positions.numel()}


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


# -- the parent ----------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64,2048")
    ap.add_argument("--child", choices=["time", "memory"], help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (each runs every path once)")
    a = ap.parse_args()
    if a.child == "memory":
        print(json.dumps(memory_child(a.shape, a.path)))
        return
    if a.child == "time":
        print(json.dumps(time_child(a.shape, a.rounds)))
        return
    rounds = a.rounds
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    load, rows = [load_average()], []
    for shape in a.shapes.split(","):
        timed = run_child("bench.logprobs", "--child", "time", "--shape", shape, "--rounds", str(rounds), env=env)
        mem = {p: run_child("bench.logprobs", "--child", "memory", "--shape", shape, "--path", p, env=env)["peak_mb"]
               for p in PATHS}
        load.append(load_average())
        for p in PATHS:
            t = timed["times"][p]
            rows.append({"shape": shape, "path": p, "cpu_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                         "peak_mb": mem[p], "max_rel_diff": timed["max_rel_diff"][p], "scored_tokens": timed["tokens"],
                         "positions": timed["positions"], "times": t})
    for shape in dict.fromkeys(r["shape"] for r in rows):
        group = {r["path"]: r for r in rows if r["shape"] == shape}
        for r in group.values():
            r["x_sliced_time"] = r["cpu_s"] / group["sliced"]["cpu_s"]
            r["x_sliced_memory"] = r["peak_mb"] / group["sliced"]["peak_mb"] if r["peak_mb"] else None
    print(f"token logprobs forward+backward, 1 thread, {rounds} interleaved rounds; load average "
          f"{min(load):.1f}-{max(load):.1f}")
    print(table(rows, ["shape", "path", "cpu_s", "min_s", "max_s", "x_sliced_time", "peak_mb", "x_sliced_memory",
                       "max_rel_diff"]))
    path = save("logprobs", {"shapes": {k: SHAPES[k] for k in a.shapes.split(",")}, "policy": POLICY,
                             "rounds": rounds, "rows": rows, "load_average": load,
                             "command": " ".join(["python -m bench.logprobs", *sys.argv[1:]])})
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path}", file=sys.stderr)


def plot(rows: list[dict], path) -> None:
    plt = pyplot()
    if plt is None:
        return
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.3))
    width = 0.8 / len(PATHS)  # one bar per path within each shape
    for i, p in enumerate(PATHS):
        xs = [j + i * width for j in range(len(shapes))]
        by = {r["shape"]: r for r in rows if r["path"] == p}
        axes[0].bar(xs, [by[s]["cpu_s"] for s in shapes], width, label=p)
        axes[1].bar(xs, [by[s]["peak_mb"] or 0 for s in shapes], width, label=p)
    for ax, label in zip(axes, ("CPU s per forward+backward", "peak MB above the pre-step RSS")):
        ax.set_xticks([j + width * (len(PATHS) - 1) / 2 for j in range(len(shapes))], [f"{s} tokens" for s in shapes])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("token logprobs with gradients: plain full logits, v1 sliced, fused (default, keep 0)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
