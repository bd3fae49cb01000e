"""Loop-step speed against TRL's ``GRPOTrainer`` on the same ~30M-parameter Qwen2 policy (32k vocab).

    .venv/bin/python -m bench.speed_vs_trl                 # both engines, 4 loop steps per run (3 timed)
    .venv/bin/python -m bench.speed_vs_trl --engines hf    # (a) only: both on transformers generate

Needs TRL in a separate venv (``make bench-env``: ``.venv-bench``, TRL 1.16 + this package); this
script runs in the main ``.venv``. Every run is a fresh subprocess on the same machine with the same
thread count (one by default); for each engine the two frameworks run at the same time (``--sequential``:
one after the other), so both see the same neighbours' load; on an idle 2-core machine each has a core.

Matched: the policy folder (float32 weights), the prompts (built-in ``arith`` task, same texts in the same
order), the group size (8), prompts per loop step (4, so 32 completions), the completion cap (64 new tokens),
sampling (temperature 1, top-p 1, top-k off), one optimizer step per collected batch of one forward/backward
over all 32 completions (TRL ``per_device_train_batch_size=32``, ``gradient_accumulation_steps=1``,
``num_iterations=1``; ours ``batch_per_replica=32``, ``n_mini=n_micro=1``), AdamW lr 1e-5 constant, no
weight decay, gradient clip 1.0, beta 0 (no reference model), clip epsilon 0.2, group-std advantage scaling,
token-level loss normalization (TRL ``dapo``, ours the masked-token mean), and the reward function.
What each figure is: ``step`` = from the end of one loop step to the end of the next (median over the
timed steps; the first step is warm-up); ``generate`` = the engine call; ``update`` = forward+backward and
the optimizer step; ``sync`` = the weight push into vLLM; ``other`` = the rest (rewards, advantages,
tokenizing, logging, framework). Each is measured twice: ``_s`` wall seconds and ``_cpu_s`` process CPU
seconds. Runs use one thread (``--threads``), so on an idle machine the two agree; on a shared machine the
wall time swings with the neighbours' load while the CPU time tracks the work, so ratios use CPU time.
Not matched, and why: see ``UNMATCHED`` (saved with the results).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import bench_env_python, clocks, load_average, save, since, table

GROUP, PROMPTS_PER_STEP, MAX_NEW_TOKENS, LR = 8, 4, 64, 1e-5
POLICY = {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 1792,
          "vocab_size": 32768, "max_position_embeddings": 256}
KV_CACHE_BYTES = 256 << 20  # 32 sequences x ~70 tokens need ~10 MB; room to spare
UNMATCHED = [
    ("optimizer implementation: TRL uses the HF Trainer's default AdamW (`adamw_torch_fused`), ours torch.optim.AdamW "
    "(foreach); same hyper-parameters"),
    ("TRL logs per-token entropy (an extra reduction over the logits in its loss forward) and its default metrics; "
    "ours logs its roll-up. Both are each framework's default work per step"),
    ("TRL shuffles nothing (shuffle_dataset=False) and samples the same prompt texts in the same order, but the "
    "random draws differ, so completion lengths differ slightly (mean lengths are reported)"),
    ("vLLM runs: TRL's importance-sampling correction (on by default in vLLM mode, an extra no-grad forward per "
    "step) is turned off, since ours has no such correction and we time the same math; this only speeds TRL up"),
]


def policy_dir() -> Path:
    """The benchmark policy, built once into the tiny-policy cache (random init, seed 0)."""
    from lightning_grpo.policy import PolicyConfig, TinyPolicySpec, resolve_path

    return resolve_path(PolicyConfig(path="tiny:bench-qwen2-30m", tiny=TinyPolicySpec(**POLICY)))


def prompt_rows(n: int) -> list[dict]:
    """The first ``n`` prompts of the built-in arith task, as ``{"prompt", "answer"}`` rows."""
    from lightning_grpo.data.tasks import get_task

    return [{"prompt": it.text, "answer": it.answer} for it in get_task("arith").items(n, seed=0)]


def even_share(token_ids) -> float:
    """The reward both frameworks use: the share of even token ids in the completion. Cheap, and it varies
    within a group even for a random-init policy whose tokens mostly decode to nothing (32k ids, ~90 chars)."""
    return sum(t % 2 == 0 for t in token_ids) / max(len(token_ids), 1)


def ours_reward(rollouts) -> list[float]:
    return [even_share(r.token_ids) for r in rollouts]


# -- our side (runs in the main .venv) ------------------------------------------------------------------------------
def ours(engine: str, model: str, rows: list[dict], steps: int) -> dict:
    import torch
    from lightning.pytorch import Callback, Trainer

    from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig
    from lightning_grpo.data.prompts import PromptDataModule
    from lightning_grpo.data.rewards import RewardSpec
    from lightning_grpo.handoff import HandoffCallback
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.rollout.vllm import VLLMConfig

    torch.manual_seed(0)
    vllm = VLLMConfig(dtype="float32", enforce_eager=True, max_model_len=POLICY["max_position_embeddings"],
                      kv_cache_memory_bytes=KV_CACHE_BYTES)
    module = GRPOModule(
        policy=PolicyConfig(path=model),
        rl=GRPOConfig(batch_per_replica=GROUP * PROMPTS_PER_STEP, group_size=GROUP, max_grad_norm=1.0),
        optim=OptimConfig(lr=LR),
        rollout=RolloutConfig(engine=engine, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, vllm=vllm),
        rewards=[RewardSpec("bench.speed_vs_trl:ours_reward")],
    )
    steps_log: list[dict] = []
    acc: dict[str, list] = {"generate": [], "update": [], "sync": [], "tokens": []}

    def timed(obj, name: str, phase: str) -> None:
        """Wrap ``obj.name`` so each call adds its (wall, CPU) seconds to this step's ``phase``."""
        inner = getattr(obj, name)

        def call(*args, **kwargs):
            t0 = clocks()
            out = inner(*args, **kwargs)
            acc[phase].append(since(t0))
            if name == "generate":
                acc["tokens"].append(sum(len(r.token_ids) for r in out))
            return out

        setattr(obj, name, call)

    class Timer(Callback):
        last_end = None

        def on_train_start(self, trainer, pl_module):
            timed(pl_module.engine, "generate", "generate")
            timed(pl_module, "update", "update")
            if engine == "vllm":  # the weight push: one load_weights per bucket, then a prefix-cache reset
                timed(pl_module.engine, "load_weights", "sync")
                timed(pl_module.engine, "reset_prefix_cache", "sync")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = clocks()
            total = {k: (sum(w for w, _ in v), sum(c for _, c in v)) for k, v in acc.items() if k != "tokens"}
            steps_log.append({"step": None if self.last_end is None else (now[0] - self.last_end[0],
                                                                          now[1] - self.last_end[1]),
                              **total, "completion_tokens": acc["tokens"][-1]})
            for v in acc.values():
                v.clear()
            self.last_end = now

    # vLLM: the hand-off Callback publishes the trainer's weights to the engine before each generation.
    handoff = HandoffCallback(placement="colocated") if engine == "vllm" else None
    start = time.perf_counter()
    trainer = Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=[Timer()] + ([handoff] if handoff else []))
    data = PromptDataModule(rows, prompts_per_step=PROMPTS_PER_STEP, shuffle=False, val_size=0)
    trainer.fit(module, datamodule=data)
    return {"framework": "lightning-grpo", "engine": engine, "steps": steps_log,
            "total_s": time.perf_counter() - start, "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in module.policy.parameters())}


# -- the parent -----------------------------------------------------------------------------------------------------
PHASES = ("step", "generate", "update", "sync")


def summarize(run: dict) -> dict:
    """Medians over the timed steps of each phase's wall (``_s``) and CPU (``_cpu_s``) seconds; ``other`` is the
    per-step remainder (step - generate - update - sync), then its median, so the columns need not add up."""
    timed = [s for s in run["steps"] if s["step"] is not None]
    med = {}
    for i, suffix in ((0, "_s"), (1, "_cpu_s")):
        for k in PHASES:
            med[k + suffix] = statistics.median(s[k][i] for s in timed)
        med["other" + suffix] = statistics.median(s["step"][i] - sum(s[k][i] for k in PHASES[1:]) for s in timed)
    tokens = statistics.mean(s["completion_tokens"] for s in timed)
    return {"framework": run["framework"], "engine": run["engine"], **med, "tokens_per_step": tokens,
            "timed_steps": len(timed), "total_s": run["total_s"], "params": run.get("params"), "raw": run["steps"]}


def trl_command(engine: str, model: str, prompts: str, steps: int) -> list[str] | None:
    py = bench_env_python()
    if py is None:
        return None
    return [py, "-m", "bench.trl_child", "--engine", engine, "--model", model, "--prompts", prompts,
            "--steps", str(steps), "--group", str(GROUP), "--prompts-per-step", str(PROMPTS_PER_STEP),
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--lr", str(LR), "--kv-cache-bytes", str(KV_CACHE_BYTES),
            "--max-model-len", str(POLICY["max_position_embeddings"])]


OURS_ENGINES = ("hf", "vllm")
"""Engines both frameworks have; ``cb`` (transformers continuous batching) is TRL's alone."""


def ours_command(engine: str, model: str, prompts: str, steps: int) -> list[str]:
    return [sys.executable, "-m", "bench.speed_vs_trl", "--child", engine, "--model", model, "--prompts", prompts,
            "--steps", str(steps)]


def run_pair(engine: str, model: str, prompts: str, steps: int, threads: int, together: bool) -> list[dict]:
    """TRL's run and ours for one engine: at the same time (each on its own core when the machine is idle, both
    under the same neighbours' load), or one after the other."""
    cmds = {"trl": trl_command(engine, model, prompts, steps)}
    if engine in OURS_ENGINES:
        cmds["lightning-grpo"] = ours_command(engine, model, prompts, steps)
    out, procs = {}, {}
    for framework, cmd in cmds.items():
        if cmd is None:
            out[framework] = {"framework": framework, "engine": engine, "error": "no .venv-bench (run make bench-env)"}
            continue
        procs[framework] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                            env=_child_env(threads))
        if not together:
            out[framework] = _collect(procs.pop(framework), framework, engine)
    for framework, proc in procs.items():
        out[framework] = _collect(proc, framework, engine)
    return list(out.values())


def _collect(proc: subprocess.Popen, framework: str, engine: str) -> dict:
    stdout, stderr = proc.communicate()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"framework": framework, "engine": engine, "error": _last_error(stderr)}
    return summarize(json.loads(lines[-1]))


def _last_error(stderr: str) -> str:
    """The exception line of a child's traceback (the last line naming an Error), else its last line."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln.split(":")[0] or ln.startswith("RuntimeError")]
    return (errors or lines or ["(no output)"])[-1][:600]


def _child_env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="hf,vllm", help="comma list of: hf, vllm, cb (TRL only: continuous batching)")
    ap.add_argument("--steps", type=int, default=4, help="loop steps per run; the first is warm-up")
    ap.add_argument("--rounds", type=int, default=1, help="TRL/ours run pairs per engine (medians over rounds)")
    ap.add_argument("--sequential", action="store_true", help="run TRL then ours, not both at once")
    ap.add_argument("--threads", type=int, default=1, help="OMP/torch threads of every run (both frameworks)")
    ap.add_argument("--child", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        rows = json.loads(Path(a.prompts).read_text())
        print(json.dumps(ours(a.child, a.model, rows, a.steps)))
        return
    model = str(policy_dir())
    prompts = Path(model) / "bench-prompts.json"
    prompts.write_text(json.dumps(prompt_rows(PROMPTS_PER_STEP * a.steps)))
    runs, loads = [], []
    for engine in a.engines.split(","):
        for _ in range(a.rounds):
            loads.append(load_average())
            runs += run_pair(engine, model, str(prompts), a.steps, a.threads, together=not a.sequential)
            loads.append(load_average())
    results = combine(runs)
    print(f"loop step vs TRL GRPOTrainer: {PROMPTS_PER_STEP} prompts x {GROUP} completions x {MAX_NEW_TOKENS} new "
          f"tokens, policy {POLICY}, {a.threads} threads; load average during the runs {min(loads):.1f}-"
          f"{max(loads):.1f}")
    ok = [r for r in results["rows"] if "error" not in r]
    if ok:
        print("CPU seconds per loop step (the work done; robust to the machine's load):")
        print(table(ok, ["framework", "engine", "step_cpu_s", "generate_cpu_s", "update_cpu_s", "sync_cpu_s",
                         "other_cpu_s", "tokens_per_step"]))
        print("wall seconds per loop step:")
        print(table(ok, ["framework", "engine", "step_s", "generate_s", "update_s", "sync_s", "other_s"]))
    for r in results["rows"]:
        if "error" in r:
            print(f"{r['framework']} / {r['engine']}: FAILED: {r['error']}")
    for k, v in results["ratios"].items():
        print(f"{k}: {v:.2f}")
    path = save("speed_vs_trl", {"policy": POLICY, "group": GROUP, "prompts_per_step": PROMPTS_PER_STEP,
                                 "max_new_tokens": MAX_NEW_TOKENS, "steps": a.steps, "rounds": a.rounds,
                                 "threads": a.threads, "together": not a.sequential, "load_average": loads,
                                 "trl_version": _trl_version(),
                                 "unmatched": UNMATCHED, **results,
                                 "command": f"python -m bench.speed_vs_trl --engines {a.engines} --steps {a.steps}"
                                            f" --rounds {a.rounds}"})
    plot(results["rows"], path.with_suffix(".png"))
    print(f"wrote {path}", file=sys.stderr)


def combine(runs: list[dict]) -> dict:
    """One row per (framework, engine): the median over rounds; ratios TRL / ours per phase."""
    rows = []
    for key in dict.fromkeys((r["framework"], r["engine"]) for r in runs):
        group = [r for r in runs if (r["framework"], r["engine"]) == key]
        good = [r for r in group if "error" not in r]
        if not good:
            rows.append(group[-1])
            continue
        row = {k: statistics.median(r[k] for r in good) if isinstance(good[0][k], float) else good[0][k]
               for k in good[0] if k != "raw"}
        row["raw"] = [r["raw"] for r in good]  # per-step (wall, CPU) of each round, for the record
        row["rounds"] = len(good)
        rows.append(row)
    by = {(r["framework"], r["engine"]): r for r in rows if "error" not in r}
    ratios = {}
    for engine in ("hf", "vllm"):
        trl, mine = by.get(("trl", engine)), by.get(("lightning-grpo", engine))
        if trl and mine:
            for phase in ("step_cpu_s", "generate_cpu_s", "update_cpu_s", "step_s"):
                ratios[f"trl_{engine}/ours_{engine} {phase}"] = trl[phase] / mine[phase]
    trl_hf, ours_vllm = by.get(("trl", "hf")), by.get(("lightning-grpo", "vllm"))
    trl_best = by.get(("trl", "vllm")) or trl_hf
    if trl_best and ours_vllm:
        for phase in ("step_cpu_s", "step_s"):
            ratios[f"trl_best({trl_best['engine']})/ours_vllm {phase}"] = trl_best[phase] / ours_vllm[phase]
    return {"rows": rows, "ratios": ratios}


def _trl_version() -> str | None:
    py = bench_env_python()
    if py is None:
        return None
    out = subprocess.run([py, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or None


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    failed = [f"{r['framework']}\n{r['engine']}" for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['framework']}\n{r['engine']}" for r in rows]
    bottom = [0.0] * len(rows)
    for phase, color in (("generate_cpu_s", "tab:blue"), ("update_cpu_s", "tab:orange"),
                         ("sync_cpu_s", "tab:green"), ("other_cpu_s", "tab:gray")):
        vals = [max(r[phase], 0.0) for r in rows]
        ax.bar(labels, vals, bottom=bottom, color=color, label=phase.removesuffix("_cpu_s"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    for label in failed:  # a run that could not run on this machine keeps its place, marked
        ax.bar([label], [0.0])
        ax.text(label, 0.5, "does not run\non this machine", ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("CPU seconds per loop step (median)")
    ax.set_title(f"GRPO loop step, {PROMPTS_PER_STEP}x{GROUP} completions x {MAX_NEW_TOKENS} tokens, ~30M Qwen2",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
