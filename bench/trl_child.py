"""TRL's side of ``bench.speed_vs_trl``: one ``GRPOTrainer`` run, per-step timings and its live settings as JSON.

Runs in ``.venv-bench`` (TRL installed), started by ``bench.speed_vs_trl``; not meant to be run by hand.
Phase times come from TRL's own profiling contexts (``transformers.generate`` / ``vLLM.generate``,
``sync_weights``, ``_prepare_inputs``), captured by patching where they report, plus wall time around
``training_step`` and a callback at each optimizer step's end. The settings the parent compares with ours
are read from the running trainer (its args, its model, its optimizer), never restated here.

vLLM colocate mode: TRL builds ``vllm.LLM`` itself with fixed arguments. Two engine-build options it does not
expose are injected so the engine matches ours (float32 weights, eager mode, a fixed KV cache size): see
``_patch_vllm``. Everything else is TRL's own code path.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict

from bench.common import clocks, since

GENERATE = ("transformers.generate", "transformers.generate_batch", "vLLM.generate")
"""TRL's profiling names of the engine call, per engine (plain generate, continuous batching, vLLM)."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["hf", "cb", "vllm"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--group", type=int, required=True)
    ap.add_argument("--prompts-per-step", type=int, required=True)
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--kv-cache-bytes", type=int, required=True)
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--gradient-checkpointing", type=int, choices=[0, 1], required=True)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    a = ap.parse_args()
    print(json.dumps(run(a)))


def run(a) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.speed_vs_trl import PeakRSS, trl_reward, weights_digest

    torch.manual_seed(0)
    phases = _capture_profiling()
    if a.engine == "vllm":
        _patch_vllm(a.kv_cache_bytes)
    with open(a.prompts) as f:
        rows = json.load(f)
    tok = AutoTokenizer.from_pretrained(a.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    digest = weights_digest(model)  # before TRL touches it: the weights both frameworks start from

    out_dir = tempfile.mkdtemp(prefix="trl-bench-")
    args = GRPOConfig(
        output_dir=out_dir, max_steps=a.steps, per_device_train_batch_size=a.group * a.prompts_per_step,
        gradient_accumulation_steps=1, num_generations=a.group, num_iterations=1, max_completion_length=a.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        gradient_checkpointing=bool(a.gradient_checkpointing),  # TRL's default is True: set it, never inherit it
        use_cpu=True, bf16=a.precision == "bf16", fp16=False, report_to="none", logging_steps=1, save_strategy="no",
        shuffle_dataset=False, seed=0, dataloader_num_workers=0, disable_tqdm=True,
        use_transformers_continuous_batching=a.engine == "cb",
        use_vllm=a.engine == "vllm", vllm_mode="colocate", vllm_importance_sampling_correction=False,
        vllm_max_model_length=a.max_model_len, vllm_enable_sleep_mode=False,
    )
    steps: list[dict] = []
    peak = PeakRSS()
    settings: dict = {}

    class Timer(TrainerCallback):
        last_end = None

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            settings.update(_settings(trainer, digest))

        def on_step_begin(self, args, state, control, **kwargs):
            peak.reset()

        def on_step_end(self, args, state, control, **kwargs):
            now = clocks()
            train, prep = _total(phases.pop("training_step", [])), _total(phases.pop("_prepare_inputs", []))
            gen = _total([t for k in GENERATE for t in phases.pop(k, [])])
            ended = phases.pop("training_step_end", [now])[-1]
            # update = forward+backward (training_step minus its input preparation) + clip/optimizer step after it
            update = tuple(t - p + (n - e) for t, p, n, e in zip(train, prep, now, ended))
            steps.append({"step": None if self.last_end is None else tuple(n - e for n, e in zip(now, self.last_end)),
                          "generate": gen, "update": update, "sync": _total(phases.pop("sync_weights", [])),
                          "completion_tokens": phases.pop("tokens", [0])[-1], "peak_rss_mb": peak.read_mb(),
                          "prompts": phases.pop("prompts", [None])[-1]})
            self.last_end = now

    start = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_reward], args=args, processing_class=tok,
                          train_dataset=Dataset.from_list(rows), callbacks=[Timer()])
    _time_training_step(trainer, phases)
    trainer.train()
    return {"framework": "trl", "engine": a.engine, "steps": steps, "total_s": time.perf_counter() - start,
            "settings": settings, "trl": trl.__version__}


def _settings(trainer, digest: str) -> dict:
    """The knobs the comparison depends on, read from the live trainer (see ``speed_report.SETTINGS``)."""
    import torch

    args, model = trainer.args, trainer.model
    group = trainer.optimizer.param_groups[0]
    steps_per_batch = args.steps_per_generation * args.num_iterations // args.gradient_accumulation_steps
    return {
        "weights_sha256": digest,
        "params": sum(p.numel() for p in model.parameters()),
        "param_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "precision": "bf16-mixed" if args.bf16 else ("16-mixed" if args.fp16 else "32-true"),
        "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
        "threads": torch.get_num_threads(),
        "group_size": args.num_generations,
        "completions_per_loop_step": args.generation_batch_size,
        "optimizer_steps_per_loop_step": steps_per_batch,
        "forward_backward_chunks_per_step": args.gradient_accumulation_steps,
        "max_new_tokens": args.max_completion_length,
        "temperature": float(args.temperature),
        "top_p": float(args.top_p),
        "top_k": int(args.top_k or 0),
        "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__,
        "optimizer_kernel": _kernel(group),
        "lr": group["lr"],
        "betas": list(group["betas"]),
        "adam_eps": group["eps"],
        "weight_decay": group["weight_decay"],
        "lr_schedule": f"{args.lr_scheduler_type.value if hasattr(args.lr_scheduler_type, 'value') else args.lr_scheduler_type}"
                       f", warmup {args.warmup_steps}",
        "max_grad_norm": args.max_grad_norm,
        "kl_beta": args.beta,
        "clip_low": args.epsilon,
        "clip_high": args.epsilon if args.epsilon_high is None else args.epsilon_high,
        "advantage_scaling": str(args.scale_rewards),
        "loss_normalization": {"dapo": "token mean over the batch"}.get(args.loss_type, f"TRL {args.loss_type}"),
        "reward_functions": [f"{f.__module__}.{f.__qualname__}" for f in trainer.reward_funcs],
        "sampler": "torch.multinomial" if args.temperature > 0 and not args.use_vllm else "vLLM",
        "logprob_positions": "all positions (TRL's fused head scores only completion tokens on Triton devices)",
        "entropy": "computed every step (its loss logs it)",
    }


def _kernel(group: dict) -> str:
    return "fused" if group.get("fused") else ("foreach" if group.get("foreach") in (True, None) else "for-loop")


def _total(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    return sum(w for w, _ in pairs), sum(c for _, c in pairs)


def _capture_profiling() -> dict[str, list]:
    """Record every TRL ``profiling_context`` as (wall, CPU) seconds by its short name (TRL only reports the wall
    time, and only to wandb/mlflow/trackio)."""
    from trl.extras import profiling

    phases: dict[str, list] = defaultdict(list)
    enter = profiling.ProfilingContext.__enter__

    def start(self):
        self._bench_start = clocks()
        return enter(self)

    def record(self, duration: float) -> None:
        phases[self.name.split(".", 1)[-1]].append(since(self._bench_start))

    profiling.ProfilingContext.__enter__, profiling.ProfilingContext._log_metrics = start, record
    return phases


def _time_training_step(trainer, phases: dict[str, list]) -> None:
    """(wall, CPU) of ``training_step`` (input preparation + forward + backward) and the clocks when it ended;
    the completion tokens and the prompts (token ids, one per group) each generation served."""
    inner, score = trainer.training_step, trainer._generate_and_score_completions

    def timed(*args, **kwargs):
        t0 = clocks()
        out = inner(*args, **kwargs)
        phases["training_step"].append(since(t0))
        phases["training_step_end"].append(clocks())
        return out

    def counted(*args, **kwargs):
        out = score(*args, **kwargs)
        phases["tokens"].append(int(out["completion_mask"].sum()))
        ids, mask = out["prompt_ids"], out["prompt_mask"].bool()
        group = trainer.args.num_generations
        phases["prompts"].append([ids[i][mask[i]].tolist() for i in range(0, len(ids), group)])
        return out

    trainer.training_step, trainer._generate_and_score_completions = timed, counted


def _patch_vllm(kv_cache_bytes: int) -> None:
    """Make TRL's colocated ``vllm.LLM`` float32 + eager with a fixed KV cache, as our engine is built.

    TRL passes ``gpu_memory_utilization`` and no dtype: vLLM 0.32 would downcast the float32 checkpoint to
    bfloat16 and torch.compile the model (minutes on 2 CPU cores), and the CPU build sizes its KV cache from
    ``kv_cache_memory_bytes`` (or ``VLLM_CPU_KVCACHE_SPACE``), not from a device-memory fraction.
    """
    from trl.generation import vllm_generation

    build = vllm_generation.LLM

    def llm(*args, **kwargs):
        kwargs.update(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=kv_cache_bytes)
        return build(*args, **kwargs)

    vllm_generation.LLM = llm


if __name__ == "__main__":
    main()
