"""What logging the policy's entropy costs one GRPO update (issue 28: at most 3%), and what the bonus costs.

    .venv/bin/python -m bench.entropy_cost            # 7 interleaved rounds
    .venv/bin/python -m bench.entropy_cost --quick    # 2 rounds, a smaller batch (the smoke test)

One update = the GRPO objective's ``chunk_loss`` through the module's ``ChunkScorer`` (fused completion-only head)
plus its backward, on one chunk. Three ways, interleaved in one process (A/B/C, C/B/A rounds), CPU seconds of one
thread, median and range, the ratio to ``off`` per round (median, ``x_off``) and of the fastest runs (``x_off_min``,
the least disturbed by other load on the machine):

* ``off``: logprobs only (the path before entropy existed: a policy view without ``logprobs_and_entropy``).
* ``logged``: the default now: ``grpo/entropy`` from the same head chunks (no gradient).
* ``bonus``: ``rl.entropy_coef=0.01``: the entropy with its gradient (a checkpointed second pass of the head).

The policy is bench/logprobs.py's ~30M Qwen2 (hidden 512, 4 layers, vocabulary 32768): its head is a large share of
the update (the entropy's cost is per vocabulary entry, the decoder's per layer), so real policies, wider and deeper
with a similar vocabulary, pay a smaller share.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench.common import load_average, run_child, save, table

PATHS = ("off", "logged", "bonus")
POLICY = {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 1792,
          "vocab_size": 32768}
SHAPE = {"rows": 16, "prompt": 8, "completion": 64}
QUICK = {"rows": 4, "prompt": 8, "completion": 32}


def setup(shape: dict):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from lightning_grpo.batch import RolloutBatch

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=POLICY["vocab_size"], hidden_size=POLICY["hidden_size"],
                         intermediate_size=POLICY["intermediate_size"], num_hidden_layers=POLICY["num_layers"],
                         num_attention_heads=POLICY["num_heads"], num_key_value_heads=POLICY["num_kv_heads"],
                         max_position_embeddings=shape["prompt"] + shape["completion"] + 8, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config).train()
    rows, width = shape["rows"], shape["prompt"] + shape["completion"]
    ids = torch.randint(4, POLICY["vocab_size"], (rows, width))
    comp = (torch.arange(width) >= shape["prompt"]).expand(rows, -1).clone()
    batch = RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(comp), completion_mask=comp,
                         advantages=torch.randn(rows), rewards=torch.rand(rows), group_ids=torch.arange(rows) // 2,
                         sample_ids=torch.arange(rows), rollout_logprobs=None)
    return model, batch


def update(path: str, model, batch, scorer) -> float:
    """One chunk's loss and backward; returns the logged entropy (NaN for ``off``)."""
    from dataclasses import replace

    from lightning_grpo.objectives.grpo import GRPOObjective

    model.zero_grad(set_to_none=True)
    view = scorer.policy_view(batch)
    if path == "off":
        view = replace(view, logprobs_and_entropy=None)
    obj = GRPOObjective(entropy_coef=0.01 if path == "bonus" else 0.0)
    old = scorer.logprobs(model, batch).detach() - 0.05  # a fixed pi_old off the policy: ratios off 1
    t0 = time.process_time()
    loss, _, stats = obj.chunk_loss(batch, view, old)
    loss.backward()
    return time.process_time() - t0, float(stats.entropy)


def time_child(quick: bool, rounds: int) -> dict:
    import torch

    from lightning_grpo.fused_head import KEEP_BYTES
    from lightning_grpo.scoring import ChunkScorer

    torch.set_num_threads(1)
    model, batch = setup(QUICK if quick else SHAPE)
    scorer = ChunkScorer(model, None, None, False, 1.0, KEEP_BYTES)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    entropy = {}
    for r in range(rounds + 1):  # round 0 is warm-up
        for path in PATHS if r % 2 else reversed(PATHS):  # neither order favours a path
            seconds, entropy[path] = update(path, model, batch, scorer)
            if r:
                times[path].append(seconds)
    return {"times": times, "entropy": entropy, "tokens": int(batch.completion_mask[:, 1:].sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (each runs every path once)")
    ap.add_argument("--quick", action="store_true", help="2 rounds of a smaller batch")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    rounds = 2 if a.quick else a.rounds
    if a.child:
        print(json.dumps(time_child(a.quick, rounds)))
        return
    load = [load_average()]
    args = ["--child", "--rounds", str(rounds)] + (["--quick"] if a.quick else [])
    timed = run_child("bench.entropy_cost", *args, env={**os.environ, "OMP_NUM_THREADS": "1"})
    load.append(load_average())
    t = timed["times"]
    rows = [{"path": p, "cpu_s": statistics.median(t[p]), "min_s": min(t[p]), "max_s": max(t[p]),
             "x_off": statistics.median(x / o for x, o in zip(t[p], t["off"])), "x_off_min": min(t[p]) / min(t["off"]),
             "entropy": timed["entropy"][p]}
            for p in PATHS]
    shape = QUICK if a.quick else SHAPE
    print(f"one GRPO update (chunk_loss + backward), {shape['rows']} x {shape['completion']} completion tokens, "
          f"1 thread, {rounds} interleaved rounds; load average {min(load):.1f}-{max(load):.1f}")
    print(table(rows, ["path", "cpu_s", "min_s", "max_s", "x_off", "x_off_min", "entropy"]))
    path = save("entropy_cost", {"policy": POLICY, "shape": shape, "rounds": rounds, "rows": rows, "times": t,
                                 "load_average": load,
                                 "command": " ".join(["python -m bench.entropy_cost", *sys.argv[1:]])})
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
