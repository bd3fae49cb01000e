"""Loop-step speed against TRL's ``GRPOTrainer`` on the same ~30M-parameter Qwen2 policy (32k vocab).

    .venv/bin/python -m bench.speed_vs_trl                          # fp32: 3 interleaved rounds, 4 loop steps a run
    .venv/bin/python -m bench.speed_vs_trl --precisions fp32,bf16   # and bf16 mixed precision on both sides
    .venv/bin/python -m bench.speed_vs_trl --rounds 1 --steps 3     # a quick look

Needs TRL in a separate venv (``make bench-env``: ``.venv-bench``, TRL 1.16 + this package); this script runs
in the main ``.venv``. Runs per round, each a fresh subprocess with one thread, one at a time:

* TRL on transformers ``generate`` with gradient checkpointing **off** (its fastest exact setting) and **on**
  (its default: ``GRPOConfig.gradient_checkpointing=True``); set explicitly both times, and read back from the
  model it trains;
* ours with the transformers engine and with our in-process vLLM engine;
* a GEMM child: the policy's own matmuls (forward, input grad, weight grad of every weight matrix) timed at one
  thread, giving the single-thread GEMM rate and the update's matmul floor ``6 x params x tokens / rate``.

Rounds interleave every run (A/B/C/D, then rotated), so a neighbour's load hits each alike; ratios are formed
per round (TRL / ours in that round) and reported as median and range. Times are CPU seconds (process user +
system; one thread, so on an idle machine they equal wall time; on a shared machine they track the work).
TRL's vLLM colocate mode is tried once per run of this script (it fails on CPU; see docs/benchmarks.md).

Matched settings are not asserted here: each child reports the values it actually runs with (``speed_report.SETTINGS``,
read from the live trainer, model and optimizer), the parent compares them key by key and saves the comparison;
the reward functions are compared on probe completions. What each figure is: ``step`` = from the end of one
loop step to the end of the next (the first step is warm-up); ``generate`` = the engine call; ``update`` =
forward+backward and the optimizer step; ``sync`` = the weight push into vLLM; ``peak_rss_mb`` = the process's
peak RSS within a loop step (the kernel's high-water mark is reset when the step starts).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import bench_env_python, clocks, cpu_flags, load_average, save, since
from bench.speed_report import combine, plot, print_summary

GROUP, PROMPTS_PER_STEP, MAX_NEW_TOKENS, LR = 8, 4, 64, 1e-5
POLICY = {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 1792,
          "vocab_size": 32768, "max_position_embeddings": 256}
KV_CACHE_BYTES = 256 << 20  # 32 sequences x ~70 tokens need ~10 MB; room to spare
@dataclass(frozen=True)
class Run:
    framework: str  # "trl" | "ours"
    engine: str  # "hf" | "vllm"
    precision: str = "fp32"  # "fp32" | "bf16" (mixed)
    gc: bool = False  # gradient checkpointing (TRL's knob; ours has none)

    @property
    def label(self) -> str:
        gc = (" gc-on" if self.gc else " gc-off") if self.framework == "trl" else ""
        return f"{self.framework}/{self.engine}{gc} {self.precision}"


def runs_of(precisions: list[str]) -> list[Run]:
    return [r for p in precisions for r in (Run("trl", "hf", p, gc=False), Run("trl", "hf", p, gc=True),
                                            Run("ours", "hf", p), Run("ours", "vllm", p))]


# -- shared by both sides ----------------------------------------------------------------------------------------------
def policy_dir() -> Path:
    """The benchmark policy, built once into the tiny-policy cache (random init, seed 0)."""
    from lightning_grpo.policy import PolicyConfig, resolve_path
    from lightning_grpo.tiny.spec import TinyPolicySpec

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


def trl_reward(completion_ids, **kwargs) -> list[float]:
    return [even_share(ids) for ids in completion_ids]


def weights_digest(model) -> str:
    """sha256 of every tensor of the state dict, by name: the same weights on both sides."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class PeakRSS:
    """The process's peak RSS within a window: ``reset()`` sets the kernel's high-water mark to the current RSS."""

    def reset(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def read_mb(self) -> float | None:
        try:
            with open("/proc/self/status") as f:
                return next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith("VmHWM"))
        except (OSError, StopIteration):
            return None


# -- our side (runs in the main .venv) ------------------------------------------------------------------------------
def ours(engine: str, precision: str, model: str, rows: list[dict], steps: int) -> dict:
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
    vllm = VLLMConfig(dtype="float32" if precision == "fp32" else "bfloat16", enforce_eager=True,
                      max_model_len=POLICY["max_position_embeddings"], kv_cache_memory_bytes=KV_CACHE_BYTES)
    module = GRPOModule(
        policy=PolicyConfig(path=model),
        rl=GRPOConfig(batch_per_replica=GROUP * PROMPTS_PER_STEP, group_size=GROUP, max_grad_norm=1.0),
        optim=OptimConfig(lr=LR),
        rollout=RolloutConfig(engine=engine, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, vllm=vllm),
        rewards=[RewardSpec("bench.speed_vs_trl:ours_reward")],
    )
    steps_log: list[dict] = []
    acc: dict[str, list] = {"generate": [], "update": [], "sync": [], "tokens": [], "prompts": []}
    peak, settings = PeakRSS(), {}

    def timed(obj, name: str, phase: str) -> None:
        """Wrap ``obj.name`` so each call adds its (wall, CPU) seconds to this step's ``phase``."""
        inner = getattr(obj, name)

        def call(*args, **kwargs):
            t0 = clocks()
            out = inner(*args, **kwargs)
            acc[phase].append(since(t0))
            if name == "generate":
                acc["tokens"].append(sum(len(r.token_ids) for r in out))
                acc["prompts"].append([list(p.token_ids) for p in args[0]])
            return out

        setattr(obj, name, call)

    class Timer(Callback):
        last_end = None

        def on_train_start(self, trainer, pl_module):
            settings.update(_our_settings(trainer, pl_module, weights_digest(pl_module.policy)))  # before any step
            timed(pl_module.engine, "generate", "generate")
            timed(pl_module, "update", "update")
            if engine == "vllm":  # the weight push: one load_weights per bucket, then a prefix-cache reset
                timed(pl_module.engine, "load_weights", "sync")
                timed(pl_module.engine, "reset_prefix_cache", "sync")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            peak.reset()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = clocks()
            total = {k: (sum(w for w, _ in acc[k]), sum(c for _, c in acc[k])) for k in ("generate", "update", "sync")}
            steps_log.append({"step": None if self.last_end is None else (now[0] - self.last_end[0],
                                                                          now[1] - self.last_end[1]),
                              **total, "completion_tokens": acc["tokens"][-1], "peak_rss_mb": peak.read_mb(),
                              "prompts": acc["prompts"][-1]})
            for v in acc.values():
                v.clear()
            self.last_end = now

    # vLLM: the hand-off Callback publishes the trainer's weights to the engine before each generation.
    handoff = HandoffCallback(placement="colocated") if engine == "vllm" else None
    trainer = Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      precision="32-true" if precision == "fp32" else "bf16-mixed",
                      callbacks=[Timer()] + ([handoff] if handoff else []))
    data = PromptDataModule(rows, prompts_per_step=PROMPTS_PER_STEP, shuffle=False, val_size=0)
    trainer.fit(module, datamodule=data)
    return {"framework": "ours", "engine": engine, "steps": steps_log, "settings": settings}


def _our_settings(trainer, module, digest: str) -> dict:
    """The same keys as TRL's side (``trl_child._settings``), read from our live trainer, module and optimizer."""
    import torch

    opt = trainer.optimizers[0]
    group = opt.param_groups[0]
    rl, o, s = module.rl, module.optim_cfg, module.sampling()
    objective = {"GRPOObjective": "token mean over the batch"}.get(type(module.objective).__name__, "?")
    return {
        "weights_sha256": digest, "params": sum(p.numel() for p in module.policy.parameters()),
        "param_dtype": str(next(module.policy.parameters()).dtype).removeprefix("torch."),
        "precision": str(trainer.precision), "threads": torch.get_num_threads(),
        "gradient_checkpointing": bool(getattr(module.policy, "is_gradient_checkpointing", False)),
        "group_size": rl.group_size, "completions_per_loop_step": rl.batch_per_replica,
        "optimizer_steps_per_loop_step": rl.n_mini, "forward_backward_chunks_per_step": rl.n_micro,
        "max_new_tokens": s.max_new_tokens, "temperature": float(s.temperature), "top_p": float(s.top_p),
        "top_k": int(s.top_k), "optimizer": type(opt).__name__,
        "optimizer_kernel": "fused" if group.get("fused") else ("foreach" if group.get("foreach") in (True, None)
                                                                else "for-loop"),
        "lr": group["lr"], "betas": list(group["betas"]), "adam_eps": group["eps"],
        "weight_decay": group["weight_decay"], "lr_schedule": f"{o.schedule}, warmup {o.warmup_steps}",
        "max_grad_norm": rl.max_grad_norm, "kl_beta": rl.beta, "clip_low": module.objective.epsilon,
        "clip_high": module.objective.epsilon_high, "advantage_scaling": rl.scale_rewards,
        "loss_normalization": objective,
        "reward_functions": [spec.name.replace(":", ".") for spec in module.reward_specs],
        "sampler": "inverse CDF (one uniform per row)" if module.rollout_cfg.engine == "hf" else "vLLM",
        "logprob_positions": "completion positions (fused head)", "entropy": "not computed",
    }


# -- the GEMM floor ------------------------------------------------------------------------------------------------------
def gemm_rate(precision: str) -> dict:
    """Single-thread GEMM rate on the policy's own matmuls: for every weight matrix [out, in], the forward
    ``[M, in] x [in, out]``, the input gradient and the weight gradient, M = the tokens of one update."""
    import time

    import torch

    torch.set_num_threads(1)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    h, kv = POLICY["hidden_size"], POLICY["hidden_size"] * POLICY["num_kv_heads"] // POLICY["num_heads"]
    layer = [(h, h), (kv, h), (kv, h), (h, h), (POLICY["intermediate_size"], h), (POLICY["intermediate_size"], h),
             (h, POLICY["intermediate_size"])]
    body, completion = GROUP * PROMPTS_PER_STEP * (MAX_NEW_TOKENS + 3), GROUP * PROMPTS_PER_STEP * MAX_NEW_TOKENS
    shapes = [(body, o, i) for o, i in layer] * POLICY["num_layers"] + [(completion, POLICY["vocab_size"], h)]
    flops, seconds = 0, 0.0
    for m, out, inp in shapes:
        x, w, dy = (torch.randn(m, inp, dtype=dtype), torch.randn(out, inp, dtype=dtype),
                    torch.randn(m, out, dtype=dtype))
        x @ w.T  # warm-up
        c0 = time.process_time()
        x @ w.T, dy @ w, dy.T @ x
        seconds += time.process_time() - c0
        flops += 6 * m * out * inp
    return {"precision": precision, "gflops": flops / seconds / 1e9, "seconds": seconds}


# -- the parent ----------------------------------------------------------------------------------------------------------
def command(run: Run, model: str, prompts: str, steps: int) -> list[str] | None:
    if run.framework == "ours":
        return [sys.executable, "-m", "bench.speed_vs_trl", "--child", run.engine, "--precision", run.precision,
                "--model", model, "--prompts", prompts, "--steps", str(steps)]
    py = bench_env_python()
    if py is None:
        return None
    return [py, "-m", "bench.trl_child", "--engine", run.engine, "--model", model, "--prompts", prompts,
            "--steps", str(steps), "--group", str(GROUP), "--prompts-per-step", str(PROMPTS_PER_STEP),
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--lr", str(LR), "--kv-cache-bytes", str(KV_CACHE_BYTES),
            "--max-model-len", str(POLICY["max_position_embeddings"]), "--gradient-checkpointing", str(int(run.gc)),
            "--precision", run.precision]


def execute(cmd: list[str] | None, run: Run, threads: int) -> dict:
    base = {"run": asdict(run), "label": run.label}
    if cmd is None:
        return {**base, "error": "no .venv-bench (run make bench-env)"}
    load = load_average()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(threads), check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {**base, "error": last_error(proc.stderr), "load": [load, load_average()]}
    return {**base, **summarize(json.loads(lines[-1])), "load": [load, load_average()]}


def summarize(out: dict) -> dict:
    """Medians over the timed steps (the first is warm-up) of each phase's CPU (``_cpu_s``) and wall (``_s``) seconds."""
    timed = [s for s in out["steps"] if s["step"] is not None]
    med = {}
    for i, suffix in ((0, "_s"), (1, "_cpu_s")):
        for k in ("step", "generate", "update", "sync"):
            med[k + suffix] = statistics.median(s[k][i] for s in timed)
    rss = [s["peak_rss_mb"] for s in timed if s.get("peak_rss_mb")]
    prompts = json.dumps([s["prompts"] for s in out["steps"]])
    settings = {**out.get("settings", {}), "prompts_sha256": hashlib.sha256(prompts.encode()).hexdigest()}
    return {**med, "tokens_per_step": statistics.mean(s["completion_tokens"] for s in timed),
            "peak_rss_mb": max(rss) if rss else None, "timed_steps": len(timed), "settings": settings,
            "raw": [{k: s[k] for k in ("step", "generate", "update", "sync", "peak_rss_mb")} for s in out["steps"]]}


def last_error(stderr: str) -> str:
    """The exception line of a child's traceback (the last line naming an Error), else its last line."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln.split(":")[0] or ln.startswith("RuntimeError")]
    return (errors or lines or ["(no output)"])[-1][:600]


def child_env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precisions", default="fp32", help="comma list of fp32, bf16 (mixed precision, both sides)")
    ap.add_argument("--steps", type=int, default=4, help="loop steps per run; the first is warm-up")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every run")
    ap.add_argument("--threads", type=int, default=1, help="OMP/torch threads of every run (both frameworks)")
    ap.add_argument("--no-trl-vllm", action="store_true", help="skip the (failing on CPU) TRL vLLM attempt")
    ap.add_argument("--child", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--gemm", help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        rows = json.loads(Path(a.prompts).read_text())
        print(json.dumps(ours(a.child, a.precision, a.model, rows, a.steps)))
        return
    if a.gemm:
        print(json.dumps(gemm_rate(a.gemm)))
        return
    precisions = a.precisions.split(",")
    model = str(policy_dir())
    prompts = Path(model) / "bench-prompts.json"
    prompts.write_text(json.dumps(prompt_rows(PROMPTS_PER_STEP * a.steps)))
    runs, results, gemm = runs_of(precisions), [], []
    for r in range(a.rounds):
        order = runs[r % len(runs):] + runs[: r % len(runs)]  # rotated: no run always goes first
        for run in order:
            print(f"round {r + 1}/{a.rounds}: {run.label}", file=sys.stderr, flush=True)
            results.append({**execute(command(run, model, str(prompts), a.steps), run, a.threads), "round": r})
        for p in precisions:
            out = subprocess.run([sys.executable, "-m", "bench.speed_vs_trl", "--gemm", p], capture_output=True,
                                 text=True, env=child_env(1), check=True)
            gemm.append({**json.loads(out.stdout.strip().splitlines()[-1]), "round": r})
    trl_vllm = None
    if not a.no_trl_vllm:
        trl_vllm = execute(command(Run("trl", "vllm", "fp32"), model, str(prompts), 2), Run("trl", "vllm"), a.threads)
    summary = combine(results, gemm, reward_check())
    print_summary(summary, a, trl_vllm)
    path = save("speed_vs_trl", {
        "policy": POLICY, "group": GROUP, "prompts_per_step": PROMPTS_PER_STEP, "max_new_tokens": MAX_NEW_TOKENS,
        "steps": a.steps, "rounds": a.rounds, "threads": a.threads, "precisions": precisions, "cpu_flags": cpu_flags(),
        "trl_version": trl_version(), "results": results, "gemm": gemm, "trl_vllm": trl_vllm, **summary,
        "load_average": [x for r in results if "load" in r for x in r["load"]],
        "command": "python -m bench.speed_vs_trl " + " ".join(sys.argv[1:])})
    plot(summary, path.with_suffix(".png"))
    print(f"wrote {path}", file=sys.stderr)


def reward_check() -> dict:
    """Both reward adapters score probe completions alike (they wrap the same ``even_share``)."""
    from types import SimpleNamespace

    probes = [[2, 4, 6], [1, 3], [7, 8, 10, 11], [], list(range(40))]
    ours_scores = ours_reward([SimpleNamespace(token_ids=p) for p in probes])
    trl_scores = trl_reward(probes)
    return {"probes": probes, "ours": ours_scores, "trl": trl_scores, "equal": ours_scores == trl_scores}


def trl_version() -> str | None:
    py = bench_env_python()
    if py is None:
        return None
    out = subprocess.run([py, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or None


if __name__ == "__main__":
    main()
