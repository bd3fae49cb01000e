"""In-flight weight updates vs a sync that waits for idle, on a long-tail batch at staleness 1, side by side (issue 43).

    .venv/bin/python -m bench.inflight                 # 3 interleaved rounds of both modes, 8 loop steps each
    .venv/bin/python -m bench.inflight --quick         # 1 round, 5 steps

One launched ``vllm serve`` (the SMALL tiny policy of the tests, float32, eager, one thread) serves both modes; each
run connects a fresh engine to it by URL, with ``server.inflight_updates`` false ("idle": every sync waits until
nothing is in flight) or true ("inflight": the sync cuts the batch in flight, and the next batch goes in flight at
once). The loop is the async schedule itself (``AsyncRollouts``, ``max_off_policy_steps: 1``): take the batch, put
the next in flight, update, push the weights through the wrapper (checked: version and probe).

The batch: ``--prompts`` prompts x 4 samples; the last prompt's group may draw ``--tail`` times the others' token budget
(``--tokens``), so a few completions run ~8x longer than the median. The update is the policy's weights moved by
noise plus ``--update-s`` seconds of trainer work modelled as a sleep: on this 2-core machine a real update would
measure how the trainer and the server share the cores, not the schedule; on a GPU the update runs beside the server.
Figures (wall seconds): ``step`` = median loop step over the steps after 2 warm-up ones; ``ratio`` = idle step /
inflight step in the same round. The tokens' lengths actually drawn are reported (the tiny policy may stop early).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from bench.common import save

GROUP = 4
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128}


def policy_folder():
    from lightning_grpo.policy import PolicyConfig, resolve_path
    from lightning_grpo.tiny.spec import TinyPolicySpec

    return resolve_path(PolicyConfig(path="tiny:bench-inflight", tiny=TinyPolicySpec(**TINY)))


def batch(step: int, args):
    """Loop step ``step``'s prompts and sampling (its own seed)."""
    from lightning_grpo.rollout.base import Prompt, SamplingConfig

    prompts = [Prompt(id=step * 100 + i, token_ids=[5 + i, 6, 7, 8, 9 + step % 7]) for i in range(args.prompts)]
    return prompts, SamplingConfig(max_new_tokens=args.tokens, seed=step, logprobs=True)


def long_tail_job(engine, args, prompts, sampling):
    """One batch: the last prompt's group with ``tail`` x the token budget, drawn beside the others."""
    long = dataclasses.replace(sampling, max_new_tokens=args.tokens * args.tail)
    with ThreadPoolExecutor(2) as pool:
        short = pool.submit(engine.generate, prompts[:-1], GROUP, sampling)
        tail = pool.submit(engine.generate, prompts[-1:], GROUP, long)
        return short.result() + tail.result(), {}


def update(policy, step: int, seconds: float) -> None:
    import torch

    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    time.sleep(seconds)


def run(url: str, folder, policy, inflight: bool, args) -> dict:
    """``args.steps`` loop steps of the async schedule against the server at ``url``; per-step wall times."""
    from lightning_grpo.collect.async_rollouts import AsyncRollouts
    from lightning_grpo.rollout.server_config import ServerConfig
    from lightning_grpo.rollout.vllm_server import VLLMServerEngine, sequence_logprobs
    from lightning_grpo.rollout.weight_sync import push_weights

    config = ServerConfig(url=url, dtype="float32", inflight_updates=inflight)
    engine = VLLMServerEngine(folder, config, reference=functools.partial(sequence_logprobs, policy))
    push_weights(policy, engine)  # the trainer's weights, whatever the last run left
    weights = [0]
    rollouts = AsyncRollouts(engine, 1, weights_step=lambda: weights[0])
    job = functools.partial(long_tail_job, engine, args)
    times: list[float] = []
    syncs: list[float] = []
    lengths: list[int] = []
    cut = 0
    last = time.monotonic()
    for step in range(1, args.steps + 1):
        got, _, _ = rollouts.take(step, *batch(step, args), job)
        rollouts.submit_ahead(step, functools.partial(_ahead, step, args), job)
        lengths += [len(r.token_ids) for r in got]
        cut += sum(1 for r in got if r.versions and len(set(r.versions)) > 1)
        update(policy, step, args.update_s)
        weights[0] = step
        start = time.monotonic()
        push_weights(policy, rollouts)
        syncs.append(time.monotonic() - start)
        times.append(time.monotonic() - last)
        last = time.monotonic()
    rollouts.close()  # a server at a URL: what is in flight finishes first
    return {"step_s": statistics.median(times[2:]), "sync_s": statistics.median(syncs[2:]), "steps_s": times,
            "median_len": statistics.median(lengths), "max_len": max(lengths), "rows_cut": cut, "rows": len(lengths)}


def _ahead(step: int, args, i: int):
    return batch(step + i, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="loop steps per run; the first two are warm-up")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per batch (x4 samples); the last one is the tail")
    ap.add_argument("--tokens", type=int, default=24, help="token budget of the short groups")
    ap.add_argument("--tail", type=int, default=8, help="the tail group's budget, in multiples of --tokens")
    ap.add_argument("--update-s", type=float, default=1.0, help="seconds of modelled trainer work per update")
    ap.add_argument("--quick", action="store_true", help="1 round of 5 steps")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 5
    from lightning_grpo.policy import PolicyConfig, load_policy
    from lightning_grpo.rollout.server_config import ServerConfig
    from lightning_grpo.rollout.vllm_server import VLLMServerEngine

    folder = policy_folder()
    policy, _ = load_policy(PolicyConfig(path=str(folder)))
    launcher = VLLMServerEngine(folder, ServerConfig(dtype="float32", max_model_len=256, enforce_eager=True,
                                                     threads=1, kv_cache_memory_bytes=64 << 20))
    rounds = []
    try:
        for r in range(args.rounds):
            order = [False, True] if r % 2 == 0 else [True, False]  # alternated: a neighbour's load hits both alike
            runs = {("inflight" if mode else "idle"): run(launcher.url, folder, policy, mode, args) for mode in order}
            rounds.append({"round": r + 1, "idle_step_s": runs["idle"]["step_s"],
                           "inflight_step_s": runs["inflight"]["step_s"],
                           "ratio": runs["idle"]["step_s"] / runs["inflight"]["step_s"], "runs": runs})
            print(json.dumps({k: v for k, v in rounds[-1].items() if k != "runs"}), flush=True)
    finally:
        launcher.close()
    summary = {key: statistics.median(r[key] for r in rounds) for key in ("idle_step_s", "inflight_step_s", "ratio")}
    save("inflight", {"command": "python -m bench.inflight " + " ".join(sys.argv[1:]), "args": vars(args),
                      "summary": summary, "rounds": rounds})
    print(json.dumps(summary))


def section(d: dict | None, md_table, load_range) -> str:
    """The docs/benchmarks.md section (rendered by bench/report.py)."""
    title = "## 3g. In-flight weight updates on a long-tail batch (`rollout.server.inflight_updates`)"
    if not d:
        return f"{title}\n\nNot run."
    a = d["args"]
    rows = [{"round": r["round"], "idle": r["idle_step_s"], "inflight": r["inflight_step_s"], "ratio": r["ratio"],
             "idle_sync": r["runs"]["idle"]["sync_s"], "inflight_sync": r["runs"]["inflight"]["sync_s"],
             "lengths": f"{r['runs']['inflight']['median_len']:.0f} / {r['runs']['inflight']['max_len']}",
             "cut": f"{r['runs']['inflight']['rows_cut']} of {r['runs']['inflight']['rows']}"} for r in d["rounds"]]
    return "\n".join([
        title,
        "",
        (f"`{d['command']}`: one launched `vllm serve` (the tests' SMALL tiny policy, float32, eager, one thread), the "
         f"async schedule at `max_off_policy_steps: 1`, {a['prompts']} prompts x 4 samples a batch, {a['tokens']} new "
         f"tokens but {a['tokens'] * a['tail']} for the last prompt's group, an update of {a['update_s']} s (modelled "
         "trainer work) per loop step; *idle*: every sync waits until nothing is in flight, *inflight*: the sync cuts "
         "the batch in flight and puts the next one in flight. Median loop step (s) after 2 warm-up steps per run; "
         "the runs of a round alternate." + load_range(d)),
        "",
        md_table(rows, [("round", "round"), ("idle", "idle step s"), ("inflight", "inflight step s"),
                        ("ratio", "idle / inflight"), ("idle_sync", "idle sync s"),
                        ("inflight_sync", "inflight sync s"), ("lengths", "median / max tokens"),
                        ("cut", "rows cut by a sync")]),
        "",
        f"Median ratio over the rounds: **{d['summary']['ratio']:.2f}x**.",
    ])


if __name__ == "__main__":
    main()
