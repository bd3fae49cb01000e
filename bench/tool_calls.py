"""Multi-turn episodes: tool calls one at a time vs side by side (``model.env.tool_workers``).

    .venv/bin/python -m bench.tool_calls             # 32 episodes, workers 1/4/16, 3 interleaved rounds
    .venv/bin/python -m bench.tool_calls --quick     # 8 episodes, workers 1/8, 1 round (smoke)

A tiny chat policy (random init) plays episodes through the transformers engine; the parser reads every model turn
as one call, so each live episode calls a tool on each turn but its last (up to ``max_turns - 1`` calls). Two tools:

- ``wait``: returns after ``--latency`` seconds of sleep, as an HTTP request or a sandbox process does (the
  thread waits without the GIL): what ``tool_workers`` is for.
- ``crunch``: ``--latency`` seconds of pure-Python arithmetic (holds the GIL): the case it cannot help.

Per round every (tool, workers) pair plays the same seeded episodes once, pairs in turn; wall seconds of
``EpisodeRunner.play``, medians over rounds. *tool s* = calls x latency (the tools' own time one after another).
Every pair's rollouts are checked equal to ``workers = 1``'s (token ids, masks, rewards).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.common import save, table
from lightning_grpo.envs import EnvConfig, EpisodeRunner, ToolCall
from lightning_grpo.rollout.base import Prompt, SamplingConfig

LATENCY = {"s": 0.05, "iterations": 0}  # set by --latency (iterations: crunch's work for that long, calibrated)


class Tools:
    """The bench environment: one waiting tool, one computing tool; the reward is the last result's parity."""

    reward = 0.0

    def reset(self, **row) -> None:
        self.reward = 0.0

    def wait(self, key: int) -> int:
        """Look a key up on a slow service.

        Args:
            key: the key.
        """
        time.sleep(LATENCY["s"])
        self.reward = float(key % 2)
        return key * 7

    def crunch(self, key: int) -> int:
        """Compute a checksum of the key in Python.

        Args:
            key: the key.
        """
        _crunch(key, LATENCY["iterations"])
        self.reward = float(key % 2)
        return key * 7


def _crunch(acc: int, iterations: int) -> int:
    for _ in range(iterations):
        acc = (acc * 31 + 7) % 1_000_003
    return acc


def calibrate(seconds: float) -> int:
    """Iterations of ``_crunch`` that take ``seconds`` on one thread here (a fixed amount of work, not a deadline)."""
    n, rates = 500_000, []
    for _ in range(3):
        start = time.perf_counter()
        _crunch(1, n)
        rates.append(n / (time.perf_counter() - start))
    return max(1, round(statistics.median(rates) * seconds))


def wait_every_turn(text: str) -> list[ToolCall | str]:
    return [ToolCall("wait", {"key": len(text)})]


def crunch_every_turn(text: str) -> list[ToolCall | str]:
    return [ToolCall("crunch", {"key": len(text)})]


def play(engine, tok, tool: str, workers: int, prompts: list[Prompt], group: int) -> tuple[float, list, dict]:
    runner = EpisodeRunner(EnvConfig(name="bench.tool_calls:Tools", parser=f"bench.tool_calls:{tool}_every_turn",
                                     max_turns=3, tool_workers=workers), tok, [tok.eos_token_id])
    start = time.perf_counter()
    rollouts, metrics = runner.play(engine, prompts, group, SamplingConfig(max_new_tokens=8, seed=0))
    return time.perf_counter() - start, rollouts, metrics


def measure(episodes: int, workers: list[int], rounds: int, latency: float) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_grpo.rollout.hf import HFEngine
    from lightning_grpo.tiny.build import tiny_folder
    from lightning_grpo.tiny.spec import TinyPolicySpec

    torch.set_num_threads(1)
    folder = tiny_folder("bench-tools", TinyPolicySpec(chat_template=True, seed=0))
    tok, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    # Turns end on the end token or any of a quarter of the vocabulary: a random policy's turns stay a few tokens.
    engine = HFEngine(model, tok, eos_token_ids=[tok.eos_token_id, *range(8, len(tok), 4)])
    group = 4
    prompts = [Prompt(id=i, token_ids=[], text=f"look up {i}") for i in range(episodes // group)]
    pairs = [(tool, w) for tool in ("wait", "crunch") for w in workers]
    times: dict = {p: [] for p in pairs}
    first: dict = {}
    for r in range(rounds):
        for tool, w in pairs[r % len(pairs):] + pairs[: r % len(pairs)]:  # the order rotates each round
            seconds, rollouts, metrics = play(engine, tok, tool, w, prompts, group)
            times[(tool, w)].append(seconds)
            key = [(x.token_ids, x.model_mask, x.reward) for x in rollouts]
            if first.setdefault(tool, (key, metrics)) != (key, metrics):
                raise AssertionError(f"{tool} with {w} workers played other episodes than with {workers[0]}")
    rows = []
    for tool, w in pairs:
        calls = first[tool][1]["tools/call_frequency"] * episodes
        rows.append({"tool": tool, "workers": w, "episodes": episodes, "calls": round(calls),
                     "tool_s": calls * latency, "wall_s": statistics.median(times[(tool, w)]),
                     "min_s": min(times[(tool, w)]), "max_s": max(times[(tool, w)])})
    for row in rows:
        base = next(x for x in rows if x["tool"] == row["tool"] and x["workers"] == workers[0])
        row["speedup"] = base["wall_s"] / row["wall_s"]
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--latency", type=float, default=0.05, help="seconds each tool call takes")
    ap.add_argument("--quick", action="store_true", help="8 episodes, workers 1/8, one round")
    a = ap.parse_args()
    from bench import tool_calls  # noqa: PLW0406 -- the environment is loaded from it (this runs as __main__)

    tool_calls.LATENCY.update(s=a.latency, iterations=calibrate(a.latency))
    episodes, workers, rounds = (8, [1, 8], 1) if a.quick else (32, [1, 4, 16], a.rounds)
    start = time.perf_counter()
    d = measure(episodes, workers, rounds, a.latency)
    print(table(d["rows"], ["tool", "workers", "episodes", "calls", "tool_s", "wall_s", "min_s", "max_s", "speedup"]))
    args = " ".join(sys.argv[1:])
    save("tool_calls", {**d, "command": f"python -m bench.tool_calls {args}".strip(), "rounds": rounds,
                        "latency_s": a.latency, "wall_s": time.perf_counter() - start})


def section(d: dict | None, md_table, load_range) -> str:
    """The docs/benchmarks.md section (rendered by bench/report.py)."""
    title = "## 4c. Tool calls of multi-turn episodes: one at a time vs side by side"
    if not d:
        return f"{title}\n\nNot run."
    wait = [r for r in d["rows"] if r["tool"] == "wait"]
    best = max(wait, key=lambda r: r["speedup"])
    return "\n".join([
        title,
        "",
        (f"`{d['command']}`: a tiny chat policy plays {wait[0]['episodes']} seeded episodes (up to 3 turns, a tool "
         f"call after each turn but the last) through the transformers engine, `model.env.tool_workers` = "
         f"{'/'.join(str(r['workers']) for r in wait)}; each call takes {d['latency_s'] * 1000:.0f} ms. *wait*: the "
         "tool sleeps (an HTTP request or a sandbox process: the thread waits without the GIL); *crunch*: the tool "
         "computes in pure Python (holds the GIL). Wall seconds of the episodes, median (min-max) over "
         f"{d['rounds']} interleaved rounds, one torch thread; *tool s* = calls x latency. Every setting played the "
         "same episodes (ids, masks, rewards checked equal)." + load_range(d)),
        "",
        md_table(d["rows"], [("tool", "tool"), ("workers", "workers"), ("calls", "calls"), ("tool_s", "tool s"),
                             ("wall_s", "wall s"), ("min_s", "min"), ("max_s", "max"), ("speedup", "x workers 1")]),
        "",
        (f"A waiting tool: **{best['speedup']:.2f}x** faster episodes with {best['workers']} workers. A computing "
         "tool gains nothing from threads (the GIL); run such a tool in a process of its own (the tool waits on it)."),
    ])


if __name__ == "__main__":
    main()
