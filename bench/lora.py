"""LoRA (policy.lora) on the ~30M speed-bench policy: weight-sync time per loop step, adapter-only vs merge-and-push,
and trained-parameter / gradient / optimizer-state memory with and without LoRA.

    .venv/bin/python -m bench.lora              # rank 16 on every linear layer, 7 repeats
    .venv/bin/python -m bench.lora --quick      # 3 repeats

Sync: two in-process vLLM engines (CPU build) on the same policy folder, float32: one built with
``enable_lora`` that gets just the adapter each loop step (``adapter_sync.push_policy``: written to tmpfs, loaded
as a new ``LoRARequest``), one without LoRA that gets every weight merged (``W + scale * B @ A``, computed
on the fly) through the bucketed in-place reload, which is what a LoRA trainer without adapter-only sync
(TRL) pushes. Before each repeat the adapter moves (a fresh update); the modes alternate within a repeat
so machine load hits both alike; medians are reported. After each sync the engine's prompt logprobs of a
fixed text are compared with the trainer's. Generation time of one collected batch (4 prompts x 8 x 32
tokens) is measured on both engines too: serving through the adapter (punica CPU kernels) costs something.

Memory: one real update (GRPOModule.update, AdamW) of a synthetic collected batch, full fine-tuning vs
LoRA; bytes of the trained parameters, their gradients and the optimizer state (exact tensor bytes, not RSS).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench.common import save, table

RANK, ALPHA = 16, 32
TEXT = "(12+34)*56-78=90; 3*3*3=27; 7+7=14; 100-1=99"


def engines(folder):
    from lightning_grpo.rollout.vllm import VLLMConfig, VLLMEngine

    cfg = VLLMConfig(dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=128 << 20)
    start = time.perf_counter()
    adapter = VLLMEngine(folder, cfg, lora_rank=RANK)
    built = time.perf_counter() - start
    return adapter, VLLMEngine(folder, cfg), built


def lora_policy(folder):
    from lightning_grpo import lora
    from lightning_grpo.policy import PolicyConfig, load_policy

    model, tok = load_policy(PolicyConfig(path=str(folder)))
    return lora.apply_lora(model, lora.LoraConfig(rank=RANK, alpha=ALPHA)).eval(), tok


def update_adapter(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def logprob_error(model, engine, ids: list[int]) -> float:
    from vllm import SamplingParams

    request = engine.adapters.request if engine.adapters else None
    out = engine.llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False, lora_request=request)[0]
    served = torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:])])
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    return float((served - lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]).abs().max())


def generate_seconds(engine, tok) -> float:
    from lightning_grpo.data.tasks import get_task
    from lightning_grpo.rollout.base import Prompt, SamplingConfig

    prompts = [Prompt(id=i, token_ids=tok(it.text)["input_ids"]) for i, it in enumerate(get_task("arith").items(4, seed=0))]
    start = time.perf_counter()
    engine.generate(prompts, 8, SamplingConfig(max_new_tokens=32, seed=0))
    return time.perf_counter() - start


def measure_sync(folder, repeats: int) -> tuple[list[dict], float]:
    from lightning_grpo.rollout import adapter_sync

    model, tok = lora_policy(folder)
    ids = tok(TEXT)["input_ids"]
    adapter_engine, merge_engine, built = engines(folder)
    modes = {"adapter-only": adapter_engine, "merge-and-push": merge_engine}
    times = {m: [] for m in modes}
    gen = {m: [] for m in modes}
    stats, errors = {}, {m: 0.0 for m in modes}
    try:
        for i in range(repeats + 1):  # the first round warms both engines up and is not timed
            update_adapter(model, seed=i)
            for mode, engine in modes.items():
                stats[mode] = adapter_sync.push_policy(model, engine, 256 << 20, with_base=False)
                errors[mode] = max(errors[mode], logprob_error(model, engine, ids))
                if i:
                    times[mode].append(stats[mode].seconds)
                    gen[mode].append(generate_seconds(engine, tok))
    finally:
        adapter_engine.close()
        merge_engine.close()
    rows = [{"mode": m, "tensors": stats[m].n_tensors, "MiB": stats[m].bytes / 2**20,
             "sync_ms": 1e3 * statistics.median(times[m]), "sync_min_ms": 1e3 * min(times[m]),
             "sync_max_ms": 1e3 * max(times[m]), "generate_s": statistics.median(gen[m]),
             "max_abs_logprob_err": errors[m]} for m in modes]
    return rows, built


def measure_memory(folder) -> list[dict]:
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from helpers import synthetic_batch

    from lightning_grpo import lora
    from lightning_grpo.config import GRPOConfig
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.policy import PolicyConfig

    rows = []
    batch = synthetic_batch([24, 9, 31, 16, 5, 28, 12, 20], vocab=32768, seed=0)
    for name, cfg in (("full", None), ("lora", lora.LoraConfig(rank=RANK, alpha=ALPHA))):
        module = GRPOModule(policy=PolicyConfig(path=str(folder), lora=cfg),
                            rl=GRPOConfig(batch_per_replica=8, group_size=2))
        module.configure_model()
        optimizer = module.configure_optimizers()[0][0]
        loss, _, _ = module.forward_chunk(batch, None)  # one backward: which parameters get a gradient
        loss.backward()
        grads = sum(p.grad.numel() * p.grad.element_size() for p in module.policy.parameters() if p.grad is not None)
        module.policy.zero_grad(set_to_none=True)
        module.updater.attach(optimizer)
        module.updater.update(batch)  # one AdamW step: its state exists from here on
        trained = [p for p in module.policy.parameters() if p.requires_grad]
        counts = lora.parameter_counts(module.policy)
        state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim() > 0)
        rows.append({"policy": name, "params": counts["total"], "trained": counts["trainable"],
                     "trained_MiB": sum(p.numel() * p.element_size() for p in trained) / 2**20,
                     "grad_MiB": grads / 2**20,
                     "optimizer_state_MiB": state / 2**20})
    full = rows[0]
    for r in rows:
        r["x_full_state"] = r["optimizer_state_MiB"] / full["optimizer_state_MiB"]
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 repeats")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats = 3
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from bench.speed_vs_trl import POLICY, policy_dir

    folder = policy_dir()
    memory = measure_memory(folder)
    sync, built = measure_sync(folder, args.repeats)
    import vllm

    print(table(memory, list(memory[0])))
    print()
    print(table(sync, list(sync[0])))
    ratio = sync[1]["sync_ms"] / sync[0]["sync_ms"]
    print(f"\nmerge-and-push / adapter-only sync time per loop step = {ratio:.1f}x; "
          f"LoRA optimizer state = {memory[1]['x_full_state']:.4f}x full")
    path = save("lora", {"command": "python -m bench.lora" + (f" --repeats {args.repeats}" if not args.quick
                                                             else " --quick"),
                         "rank": RANK, "alpha": ALPHA, "policy": POLICY, "repeats": args.repeats,
                         "vllm": vllm.__version__, "engine_build_s": built, "memory": memory, "sync": sync,
                         "merge_over_adapter": ratio})
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()


def section(d: dict | None, md_table, load_range) -> str:
    """The docs/benchmarks.md section (rendered by bench/report.py)."""
    title = "## 3d. LoRA: adapter-only vs merge-and-push sync, and memory"
    if not d:
        return f"{title}\n\nNot run."
    return "\n".join([
        title,
        "",
        (f"`{d['command']}`: the speed bench's ~30M Qwen2 policy with a rank-{d['rank']} adapter (alpha {d['alpha']}) "
         "on every linear layer, float32. *Sync*: two in-process vLLM engines (CPU build "
         f"{d.get('vllm', '?')}) on the same folder: one built with `enable_lora` gets the adapter alone each loop "
         "step (written to tmpfs, loaded as a new `LoRARequest`), one without LoRA gets every weight merged "
         "(`W + scale * B @ A`) through the bucketed in-place reload, as a LoRA trainer without adapter-only sync "
         f"does. {d['repeats']} repeats, the adapter moved before each, modes alternating; medians (min-max). After "
         "each sync the engine's prompt logprobs are compared with the trainer's. *generate s*: one collected batch "
         f"(4 prompts x 8 x 32 tokens) through each engine.{load_range(d)}"),
        "",
        md_table(d["sync"], [("mode", "sync"), ("tensors", "tensors"), ("MiB", "MiB moved"), ("sync_ms", "median ms"),
                             ("sync_min_ms", "min ms"), ("sync_max_ms", "max ms"), ("generate_s", "generate s"),
                             ("max_abs_logprob_err", "max abs logprob error")]),
        "",
        (f"Merge-and-push / adapter-only = **{d['merge_over_adapter']:.1f}x** sync time per loop step. Generating "
         "through the adapter costs more on CPU (vLLM's CPU LoRA path has no fused kernels), which at this model size "
         "outweighs the sync saving; see docs/lora.md."),
        "",
        "*Memory*: one real update (AdamW) of a synthetic collected batch; exact tensor bytes.",
        "",
        md_table(d["memory"], [("policy", "policy"), ("params", "parameters"), ("trained", "trained"),
                               ("trained_MiB", "trained MiB"), ("grad_MiB", "gradient MiB"),
                               ("optimizer_state_MiB", "AdamW state MiB"), ("x_full_state", "x full")]),
    ])
