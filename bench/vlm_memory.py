"""Peak memory of one vision-language update vs micro-batching: pixels are materialized per chunk.

    .venv/bin/python -m bench.vlm_memory            # 32 rows, 448x448 images (256 image tokens each)
    .venv/bin/python -m bench.vlm_memory --quick    # 16 rows, 336x336 images

A tiny Qwen2.5-VL (vision tower trained) scores a collected batch whose every prompt has its own image.
Each n_micro runs in a fresh process; we report the update's own peak RSS (high-water mark reset right
before it, minus the RSS just before it), the most pixel tensors alive at once and their bytes (each
chunk's ``pixel_values`` is tracked by a weak reference from the moment it is made), and ratios to
n_micro = 1. The collected batch itself holds image references (PNG bytes) only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import weakref

from bench.common import load_average, run_child, save, table
from bench.update_memory import _reset_peak, _status_mb

N_MICROS = [1, 2, 4, 8]


def image_batch(module, rows: int, side: int, completion: int, group_size: int = 2):
    """``rows`` trajectories of ``rows / group_size`` prompts, each prompt with its own ``side`` x ``side`` image."""
    import io

    import torch
    from PIL import Image

    from lightning_grpo.batch import pack_rollouts
    from lightning_grpo.collect.prompts import step_prompts
    from lightning_grpo.data.images import with_image_parts
    from lightning_grpo.data.prompts import PromptRecord
    from lightning_grpo.rollout.base import Rollout

    g = torch.Generator().manual_seed(0)
    records = []
    for p in range(rows // group_size):
        buf = io.BytesIO()
        pixels = torch.randint(0, 256, (side, side, 3), generator=g, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(buf, format="PNG")
        records.append(PromptRecord(p, "describe", None, {}, with_image_parts("describe", 1), (buf.getvalue(),)))
    prompts, _ = step_prompts(records, module.tokenizer, module.vision)
    lengths = torch.randint(completion // 4, completion + 1, (rows,), generator=g)
    rollouts = [Rollout(prompts[i // group_size], torch.randint(4, 60, (int(n),), generator=g).tolist(), "", "length")
                for i, n in enumerate(lengths)]
    return pack_rollouts(rollouts, torch.randn(rows, generator=g), torch.rand(rows, generator=g),
                         module.tokenizer.pad_token_id)


def child(n_micro: int, rows: int, side: int, completion: int) -> dict:
    import time

    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from lightning_grpo.config import GRPOConfig
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.tiny.spec import TinyPolicySpec

    torch.manual_seed(0)
    spec = TinyPolicySpec(arch="qwen2_5_vl", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                          intermediate_size=128, max_position_embeddings=2048)
    rl = GRPOConfig(batch_per_replica=rows, group_size=2, micro_batch_per_replica=rows // n_micro)
    policy = PolicyConfig(path="tiny:bench-vlm-memory", tiny=spec, train_vision_tower=True)
    module = GRPOModule(policy=policy, rl=rl)
    module.configure_model()
    # Larger images than the tiny processor's default cap (16 tokens), so pixels weigh what real ones do.
    module.vision.image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=side * side,
                                                             patch_size=14, merge_size=2, temporal_patch_size=2)
    module.updater.attach(torch.optim.AdamW(module.policy.parameters(), lr=1e-5))
    batch = image_batch(module, rows, side, completion)
    alive: list[weakref.ref] = []
    most = {"tensors": 0, "bytes": 0}
    real = module.vision.materialize

    def tracked(*args, **kwargs):
        inputs = real(*args, **kwargs)
        alive.append(weakref.ref(inputs.pixel_values))
        live = [r() for r in alive if r() is not None]
        most["tensors"] = max(most["tensors"], len(live))
        most["bytes"] = max(most["bytes"], sum(t.numel() * t.element_size() for t in live))
        return inputs

    module.vision.materialize = tracked
    base, reset = _status_mb("VmRSS"), _reset_peak()
    start = time.perf_counter()
    module.updater.update(batch)
    seconds = time.perf_counter() - start
    peak = _status_mb("VmHWM") if reset else float("nan")
    image_tokens = int((batch.input_ids == module.vision.image_token_id).sum())
    return {"n_micro": n_micro, "update_peak_mb": peak - base, "base_rss_mb": base, "seconds": seconds,
            "max_pixel_tensors_alive": most["tensors"], "max_pixel_mb_alive": most["bytes"] / 2**20,
            "image_tokens": image_tokens, "chunks_materialized": len(alive)}


def measure(rows: int, side: int, completion: int, n_micros=N_MICROS) -> list[dict]:
    """One fresh process per n_micro (sequential: the machine is shared, memory does not depend on timing)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = [run_child("bench.vlm_memory", "--child", str(n), "--rows", str(rows), "--side", str(side),
                         "--completion", str(completion), env=env) for n in n_micros if rows % n == 0]
    for r in results:
        r["ratio_update_peak"] = r["update_peak_mb"] / results[0]["update_peak_mb"]
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", type=int)
    ap.add_argument("--rows", type=int)
    ap.add_argument("--side", type=int)
    ap.add_argument("--completion", type=int, default=64)
    a = ap.parse_args()
    rows, side = a.rows or (16 if a.quick else 32), a.side or (336 if a.quick else 448)
    if a.child:
        print(json.dumps(child(a.child, rows, side, a.completion)))
        return
    load = [load_average()]
    results = measure(rows, side, a.completion)
    load.append(load_average())
    print(f"VLM update memory, {rows} rows x one {side}x{side} image each, completions <= {a.completion} tokens; "
          f"load average {min(load):.1f}-{max(load):.1f}")
    print(table(results, ["n_micro", "update_peak_mb", "ratio_update_peak", "max_pixel_tensors_alive",
                          "max_pixel_mb_alive", "chunks_materialized", "seconds"]))
    path = save("vlm_memory", {"rows": rows, "side": side, "completion": a.completion, "results": results,
                               "load_average": load,
                               "command": " ".join(["python -m bench.vlm_memory", *sys.argv[1:]])})
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
