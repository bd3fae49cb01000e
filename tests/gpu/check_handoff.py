"""GPU-only checks of the hand-off (one CUDA device, well under 5 minutes). Run by tests/gpu/run_gpu_checks.sh.

Not collected by pytest (no ``test_`` prefix): the CPU suite covers the logic, this covers what
only a GPU shows. Each check prints PASS / SKIP (with why) / FAIL; the exit status is 1 on any FAIL.

1. host offload: params/grads/Adam state leave the card into pinned memory (allocated bytes drop),
   come back bit-exact, and training continues exactly as without the round trip;
2. torch_memory_saver (if installed): the probe says usable; after adoption ``offload`` frees the
   trainer's bytes on the card (driver view) and ``onload`` restores them bit-exact at the same addresses;
3. a 3-step ``Trainer.fit`` on CUDA with the HF engine and the Callback: the documented event order,
   optimizer state offloaded every step, profile records with CUDA memory at every boundary;
4. vLLM (if the GPU ``vllm`` package is importable): sleep level 1 frees the card and keeps the weights;
   level 2 discards them, and wake(weights) + full sync + wake(kv_cache) gives logprobs equal to the
   trainer's; then a 3-step fit with the vLLM engine, ``sleep_level=2``, exact event order.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("LIGHTNING_GRPO_CACHE", tempfile.mkdtemp(prefix="grpo-gpu-"))

from helpers import SMALL

from lightning_grpo.offload import HostOffload, TorchMemorySaverOffload, memory_saver_usable
from lightning_grpo.policy import PolicyConfig, load_policy, resolve_path

GiB = 1 << 30


class Skip(Exception):
    """A check that cannot run here (missing package), with the reason."""


def _policy_and_optimizer(steps: int = 2):
    torch.manual_seed(0)
    model, tok = load_policy(PolicyConfig(path="tiny:gpu", tiny=SMALL))
    model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([tok("12+34=46; 7*8=56")["input_ids"]] * 4, device="cuda")
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        opt.step()
    return model, opt, ids


def _values(model, opt) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out |= {f"state{i}.{k}": v.clone() for k, v in s.items()}
    return out


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, value in a.items():
        assert torch.equal(value.cpu(), b[k].cpu()), f"{k} changed across the round trip"


def check_host_offload() -> str:
    model, opt, _ = _policy_and_optimizer()
    before, allocated = _values(model, opt), torch.cuda.memory_allocated()
    off = HostOffload([model], [opt], device="cuda")
    assert off.pin_memory, "CUDA build should pin host copies"
    t0 = time.perf_counter()
    moved = off.offload()
    t_off = time.perf_counter() - t0
    dropped = allocated - torch.cuda.memory_allocated()
    assert all(p.is_pinned() for p in model.parameters())
    assert dropped >= 0.9 * moved, f"offload moved {moved} B but allocated fell by {dropped} B"
    t0 = time.perf_counter()
    off.onload()
    torch.cuda.synchronize()
    t_on = time.perf_counter() - t0
    _equal(before, _values(model, opt))
    return f"moved {moved / 2**20:.1f} MiB, offload {t_off * 1e3:.1f} ms, onload {t_on * 1e3:.1f} ms"


def check_memory_saver() -> str:
    try:
        import torch_memory_saver  # noqa: F401
    except ImportError as err:
        raise Skip("torch_memory_saver not installed (carry its wheel: pip install torch_memory_saver)") from err
    usable, why = memory_saver_usable()
    assert usable, f"installed but not usable: {why}"
    model, opt, _ = _policy_and_optimizer()
    off = TorchMemorySaverOffload([model], [opt], device="cuda")
    off.offload()
    off.onload()  # adoption: re-allocated inside the region
    before, ptrs = _values(model, opt), [p.data_ptr() for p in model.parameters()]
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    moved = off.offload()
    freed = torch.cuda.mem_get_info()[0] - free0
    off.onload()
    assert [p.data_ptr() for p in model.parameters()] == ptrs, "resume must keep device addresses"
    _equal(before, _values(model, opt))
    assert freed >= 0.5 * moved, f"pause freed {freed} B of {moved} B"
    return f"paused {moved / 2**20:.1f} MiB, driver saw {freed / 2**20:.1f} MiB freed"


def _fit(engine: str, steps: int = 3, **handoff_kw):
    from lightning.pytorch import Trainer, seed_everything

    from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig
    from lightning_grpo.data.prompts import PromptDataModule
    from lightning_grpo.data.rewards import RewardSpec
    from lightning_grpo.handoff import HandoffCallback
    from lightning_grpo.module import GRPOModule

    seed_everything(0)
    vllm = None
    if engine == "vllm":
        from lightning_grpo.rollout.vllm import VLLMConfig

        vllm = VLLMConfig(dtype="float32", enforce_eager=True, max_model_len=256, gpu_memory_utilization=0.2,
                          kv_cache_memory_bytes=1 * GiB, enable_sleep_mode=True)
    module = GRPOModule(policy=PolicyConfig(path="tiny:gpu", tiny=SMALL), rl=GRPOConfig(batch_per_replica=8, group_size=4),
                        optim=OptimConfig(lr=3e-3), rewards=[RewardSpec("reward_fns:length_reward")],
                        rollout=RolloutConfig(engine=engine, max_new_tokens=6, vllm=vllm, sync_bucket_mb=0.05))
    cb = HandoffCallback(profile=True, **handoff_kw)
    root = tempfile.mkdtemp(prefix="handoff-fit-")
    trainer = Trainer(max_steps=steps, accelerator="cuda", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=root, num_sanity_val_steps=0, callbacks=[cb])
    trainer.fit(module, datamodule=PromptDataModule("builtin:arith", val_size=0))
    records = [json.loads(x) for x in (Path(root) / "profile.jsonl").read_text().splitlines()]
    return module, cb, records


def _expected(steps: int) -> list[str]:
    from lightning_grpo.handoff_events import CYCLE, ENGINE_SLEEP

    return [ENGINE_SLEEP] + (list(CYCLE[4:]) + list(CYCLE[:4])) * steps


def check_fit_hf() -> str:
    _, cb, records = _fit("hf")
    assert cb.events == _expected(3), cb.events
    assert cb._offload.kind == "host", "HF engine: only the optimizer state (and a reference model) moves"
    assert records[-1]["offload_bytes"]["offloaded"] > 0
    assert all("cuda_allocated" in p["memory_end"] for r in records for p in r["phases"])
    return "profile record: " + json.dumps({k: records[-1][k] for k in ("seconds", "offload_bytes")})


def _engine_logprobs(engine, ids: list[int]) -> torch.Tensor:
    from vllm import SamplingParams

    out = engine.llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)[0]
    return torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:])])


def _trainer_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=next(model.parameters()).device)).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:], device=logits.device)[:, None])[:, 0].cpu()


def check_vllm_sleep_levels() -> str:
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise Skip("the GPU vllm package is not installed") from err
    from lightning_grpo.rollout.vllm import VLLMConfig, VLLMEngine
    from lightning_grpo.rollout.weight_sync import push_weights

    model, tok = load_policy(PolicyConfig(path="tiny:gpu", tiny=SMALL))
    model = model.cuda()
    ids = tok("12+34=46; 7*8=56; 9-3=6")["input_ids"]
    engine = VLLMEngine(resolve_path(PolicyConfig(path="tiny:gpu", tiny=SMALL)), VLLMConfig(
        dtype="float32", enforce_eager=True, max_model_len=256, gpu_memory_utilization=0.2, enable_sleep_mode=True))
    try:
        assert engine.sleep_mode
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)  # the trainer moved away from the checkpoint
        free = torch.cuda.mem_get_info()[0]
        engine.sleep(1)
        freed = torch.cuda.mem_get_info()[0] - free
        engine.wake_up(["weights"])
        push_weights(model, engine)
        engine.wake_up(["kv_cache"])
        torch.testing.assert_close(_engine_logprobs(engine, ids), _trainer_logprobs(model, ids), atol=1e-4, rtol=0)
        engine.sleep(2)  # weights discarded: only a full sync brings them back
        engine.wake_up(["weights"])
        push_weights(model, engine)
        engine.wake_up(["kv_cache"])
        torch.testing.assert_close(_engine_logprobs(engine, ids), _trainer_logprobs(model, ids), atol=1e-4, rtol=0)
        assert freed > 0.5 * GiB, f"sleep(1) freed only {freed / GiB:.2f} GiB"
    finally:
        engine.close()
    return f"sleep(1) freed {freed / GiB:.2f} GiB; level 1 and level 2 logprobs equal the trainer's"


def check_fit_vllm_level_2() -> str:
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise Skip("the GPU vllm package is not installed") from err
    module, cb, records = _fit("vllm", sleep_level=2)
    try:
        assert cb.events == _expected(3), cb.events
        phases = {p["phase"]: p["memory_end"]["device_used"] for p in records[-1]["phases"]}
        return f"device_used by boundary (GiB): {json.dumps({k: round(v / GiB, 2) for k, v in phases.items()})}"
    finally:
        module.engine.close()


CHECKS = [check_host_offload, check_memory_saver, check_fit_hf, check_vllm_sleep_levels, check_fit_vllm_level_2]


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP all: no CUDA device")
        return 0
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    failed = 0
    for check in CHECKS:
        start = time.perf_counter()
        try:
            note = check()
            status = "PASS"
        except Skip as why:
            status, note = "SKIP", str(why)
        except Exception:  # noqa: BLE001 - report every check, then fail the run
            status, note, failed = "FAIL", traceback.format_exc(), failed + 1
        print(f"{status} {check.__name__} ({time.perf_counter() - start:.1f} s): {note}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
