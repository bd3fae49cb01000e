"""Shared test helpers: a small policy spec, synthetic collected batches, update deltas."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import multiprocessing
import os
import runpy
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from lightning.pytorch import Callback

from lightning_grpo.batch import RolloutBatch
from lightning_grpo.tiny.spec import TinyPolicySpec

SMALL = TinyPolicySpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
SMALL_CHAT = dataclasses.replace(SMALL, chat_template=True)
"""SMALL with a chat template on its tokenizer (the stand-in for an instruct model)."""
SMALL_VLM = dataclasses.replace(SMALL, arch="qwen2_5_vl")
"""SMALL as a Qwen2.5-VL: the same text model plus a small vision tower and an image processor."""
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"

QUICKSTART_ARGS = [
    "--config", str(Path(__file__).parents[1] / "configs" / "quickstart.yaml"),
    # shortened: 2 loop steps, a validation after each, 16 held-out prompts, a shorter warm start (cached per session)
    "--trainer.max_steps=2", "--trainer.val_check_interval=1", "--data.val_size=16",
    "--model.policy.warm_start_steps=30",
]
"""``lightning-grpo fit`` arguments of the shortened quickstart (the quickstart_run fixture, the sweep test)."""


FORKSERVER_PRELOAD = ("torch", "transformers", "lightning.pytorch", "lightning_grpo.module", "lightning_grpo.cli")
"""What the fork server imports once for every child process of the session (tests/dist processes pay it each)."""


def forked_context():
    """A multiprocessing context whose children fork from one server that imported torch, Lightning and the package
    once per session (``forkserver``): a child starts in about a second instead of re-importing them. Forking is safe
    there, unlike ``os.fork`` of pytest itself: the server ran no torch op, so no thread pool holds a lock."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return context


def run_forked(entry: str, argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 600,
               ) -> tuple[int, str, str]:
    """Run a command line in a child of the fork server (``forked_context``), as a fresh interpreter would:
    ``entry`` ``"module:function"`` is called as a console script (``lightning_grpo.__main__:main`` is
    ``lightning-grpo``), a bare ``"module"`` runs as ``python -m module``; ``sys.argv``, the working folder and the
    environment are the command's. Returns the exit code (negative: killed by that signal), stdout and stderr.

    A real process (its own exit code, its own stderr, os._exit at the end) without re-importing torch, Lightning
    and transformers: 1-2 s instead of 10-30 s of CPU per command on 2 cores.
    """
    with tempfile.TemporaryDirectory(prefix="lightning-grpo-forked-") as streams:  # not in cwd: it may be the repo
        out, err = Path(streams) / "stdout", Path(streams) / "stderr"
        child = forked_context().Process(target=_as_main, args=(entry, argv, str(cwd), dict(env), str(out), str(err)))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise AssertionError(f"{entry} {' '.join(argv)} ran past {timeout} s\n{err.read_text()[-3000:]}")
        return child.exitcode, out.read_text(), err.read_text()


def _as_main(entry: str, argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """The fork server child of ``run_forked``: an uncaught error prints its traceback and exits 1, SystemExit(n)
    exits n (multiprocessing's process bootstrap, as the interpreter's own)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.path.insert(0, cwd)  # as `python -m` and a console script run from cwd see it
    module, _, function = entry.partition(":")
    sys.argv = [entry, *argv]
    if function:
        getattr(importlib.import_module(module), function)()
    else:
        runpy.run_module(module, run_name="__main__", alter_sys=True)


def synthetic_batch(completion_lens: list[int], prompt_len: int = 4, vocab: int = 80, seed: int = 0,
                    with_logprobs: bool = False) -> RolloutBatch:
    """A collected batch with the given completion lengths (0 = an empty completion), right-padded."""
    g = torch.Generator().manual_seed(seed)
    n, width = len(completion_lens), prompt_len + max(max(completion_lens), 1)
    ids = torch.randint(4, vocab, (n, width), generator=g)
    attn = torch.zeros(n, width, dtype=torch.bool)
    comp = torch.zeros(n, width, dtype=torch.bool)
    for i, c in enumerate(completion_lens):
        attn[i, : prompt_len + c] = True
        comp[i, prompt_len : prompt_len + c] = True
    ids = ids.masked_fill(~attn, 0)
    lp = (-torch.rand(n, width, generator=g) * 2).masked_fill(~comp, 0) if with_logprobs else None
    return RolloutBatch(
        input_ids=ids, attention_mask=attn, completion_mask=comp,
        advantages=torch.randn(n, generator=g), rewards=torch.rand(n, generator=g),
        group_ids=torch.arange(n) // 2, sample_ids=torch.arange(n), rollout_logprobs=lp,
    )


def with_sampler_logprobs(batch: RolloutBatch, model: torch.nn.Module, sigma: float = 0.3, seed: int = 0,
                          ) -> RolloutBatch:
    """``batch`` with sampler logprobs = ``model``'s own plus N(0, sigma) noise per completion token: a sampler that
    is not the trainer (bf16, another kernel), so rho = pi_old / pi_rollout spreads around 1."""
    from lightning_grpo.logprobs import token_logprobs

    with torch.no_grad():
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask, positions=batch.completion_mask[:, 1:])
    noise = torch.randn(lp.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * sigma
    sampler = torch.cat([torch.zeros_like(lp[:, :1]), lp + noise.to(lp.dtype)], dim=1)
    return replace(batch, rollout_logprobs=sampler.masked_fill(~batch.completion_mask, 0))


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def max_rel_delta(before: dict, a: dict, b: dict) -> float:
    """max |Δa - Δb| / max |Δa| over all parameters: compares the *updates*, not the weights."""
    num = max(float((a[k] - b[k]).abs().max()) for k in before)
    den = max(float((a[k] - before[k]).abs().max()) for k in before)
    return num / den


def clone(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def digit_share(rollouts) -> list[float]:
    """Reward: the share of digits in the completion. Spread out even for an untrained policy (resume tests)."""
    return [sum(c.isdigit() for c in r.text) / max(len(r.text), 1) for r in rollouts]


def char_codes(rollouts) -> list[float]:
    """Reward: the mean character code of the completion / 128. Any text scores, and a different text differs."""
    return [sum(map(ord, r.text)) / max(len(r.text), 1) / 128 for r in rollouts]


# The tiny GRPO job of the determinism/resume tests: 2 prompts x 4 completions of 4 tokens, n_mini=2 (so the ahead
# pass and its probe run and global_step = 2 x loop_step), warmup + cosine LR (scheduler state matters on resume).
TINY_JOB = {
    "rl": {"batch_per_replica": 8, "group_size": 4, "mini_batch_per_replica": 4, "deterministic": True},
    "optim": {"lr": 1e-3, "warmup_steps": 3, "schedule": "cosine"},
    "rollout": {"engine": "hf", "max_new_tokens": 4},
    "rewards": [{"name": "helpers:digit_share"}],
}


def tiny_grpo_module(policy_dir, seed: int | None = 0):
    """``TINY_JOB`` as a GRPOModule on the policy folder ``policy_dir``."""
    from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig
    from lightning_grpo.data.rewards import RewardSpec
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.policy import PolicyConfig

    job = TINY_JOB
    return GRPOModule(policy=PolicyConfig(path=str(policy_dir)), rl=GRPOConfig(**job["rl"]),
                      optim=OptimConfig(**job["optim"]), rollout=RolloutConfig(**job["rollout"]),
                      rewards=[RewardSpec(**r) for r in job["rewards"]], seed=seed)


class StepRecorder(Callback):
    """Records, per loop step, the logged metrics and the prompt ids trained on."""

    def __init__(self):
        self.metrics, self.prompt_ids = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append(dict(pl_module.last_metrics))
        self.prompt_ids.append([r.id for r in batch])


def fit_tiny(module, root, loop_steps: int, callbacks=(), ckpt_path=None, val_size: int = 0, **trainer_kw):
    """``Trainer.fit`` of ``module`` for ``loop_steps`` collected batches on CPU; returns the trainer.

    ``trainer_kw`` overrides the Trainer's arguments (``logger``, ``val_check_interval``, ...).
    """
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import Checkpoint

    from lightning_grpo.data.prompts import PromptDataModule

    kw = {"max_steps": loop_steps * module.rl.steps_per_loop_step, "accelerator": "cpu", "devices": 1, "logger": False,
          "enable_progress_bar": False, "enable_model_summary": False, "default_root_dir": root,
          "enable_checkpointing": any(isinstance(c, Checkpoint) for c in callbacks), "callbacks": list(callbacks)}
    trainer = Trainer(**{**kw, **trainer_kw})
    trainer.fit(module, datamodule=PromptDataModule("builtin:arith", val_size=val_size), ckpt_path=ckpt_path)
    return trainer


@contextlib.contextmanager
def global_determinism_restored():
    """Determinism mode is process-global: put torch's switches back after a test that enabled it."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
             torch.backends.cuda.cudnn_sdp_enabled())
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
        torch.backends.cuda.enable_flash_sdp(saved[4])
        torch.backends.cuda.enable_mem_efficient_sdp(saved[5])
        torch.backends.cuda.enable_cudnn_sdp(saved[6])


def cache_hub_model(hub_cache: Path, repo_id: str, folder: Path, commit: str = HUB_COMMIT) -> Path:
    """Lay ``folder`` out in a Hugging Face Hub cache as ``repo_id`` (``models--org--name/snapshots/<commit>``,
    ``refs/main``), as a download there would; returns the snapshot folder."""
    repo = Path(hub_cache) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def cache_hub_dataset(datasets_cache: Path, repo_id: str, subset: str, files: dict[str, str]) -> Path:
    """Lay JSON Lines files out in a ``datasets`` cache as Hub dataset ``repo_id`` / ``subset`` (one file per split),
    the way ``datasets.load_dataset(repo_id, subset)`` leaves it after a download; returns the prepared folder."""
    from datasets.packaged_modules.json.json import Json

    namespace, name = repo_id.split("/")
    builder = Json(cache_dir=str(datasets_cache), dataset_name=name, config_name=subset, hash="0123456789abcdef",
                   data_files={split: [str(f)] for split, f in files.items()})
    builder.download_and_prepare()
    # The json builder names its config after the data files; a Hub download's is the subset name, under org___name.
    prepared = Path(builder.cache_dir).parents[1]
    target = Path(datasets_cache) / f"{namespace}___{name}" / subset
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(prepared), target)
    return target


def first_token_spread(rollouts, n_prompts: int, group: int) -> tuple[float, float]:
    """(across, within): mean count of distinct first tokens over the prompts at one sample index, and over the
    samples of one prompt. For identical prompts with independent noise the two agree; an engine that seeds
    sample j of every prompt alike gives across == 1."""
    first = [r.token_ids[0] for r in rollouts]  # grouped: prompt 0's group first
    grid = [first[p * group : (p + 1) * group] for p in range(n_prompts)]
    across = sum(len({grid[p][j] for p in range(n_prompts)}) for j in range(group)) / group
    within = sum(len(set(row)) for row in grid) / n_prompts
    return across, within


# -- sparse-MoE policies (routing replay) ---------------------------------------------------------------------------
MOE = TinyPolicySpec(arch="qwen3_moe", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                     num_experts=8, experts_per_token=2, init_std=0.2)
"""A routing-sensitive tiny MoE: init std 0.2 makes expert outputs and the LM head sharp enough that an expert flip
moves a token's logprob by O(0.1-1) nats, as in a trained model (at 0.02 a random model's logprobs ignore routing)."""
ROUTER_SCALE = 0.1
"""Router weights are scaled by this: high-entropy routers with many near-tied experts, the case where churn bites."""
KERNEL_NOISE = 4e-3
"""Relative noise on each router's input per forward, about half a bf16 ulp: stands in for GPU kernel non-determinism
(bf16 rounding, atomics) that CPU float32 forwards do not have (see docs/moe.md)."""


def build_moe_policy(out, arch: str = "qwen3_moe", router_scale: float = ROUTER_SCALE, **config) -> Path:
    """Build ``MOE`` as ``arch``, scale its routers, set extra config fields (e.g. output_router_logits), save."""
    from transformers import AutoModelForCausalLM

    from lightning_grpo.tiny.build import build_tiny_policy

    folder = build_tiny_policy(out, replace(MOE, arch=arch))
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("TopKRouter"):
                m.weight.mul_(router_scale)
    for k, v in config.items():
        setattr(model.config, k, v)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@contextlib.contextmanager
def kernel_noise(model: torch.nn.Module, eps: float = KERNEL_NOISE):
    """Perturb every router's input by ``1 + eps * N(0, 1)`` in every forward (a fresh draw each time)."""
    handles = [m.register_forward_pre_hook(lambda mod, args: (args[0] * (1 + eps * torch.randn_like(args[0])),))
               for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def png(size: tuple[int, int], color: tuple[int, int, int] = (200, 30, 30), seed: int = 0) -> bytes:
    """PNG bytes of a noisy image of ``size`` (width, height) around ``color``."""
    import io

    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    base = torch.tensor(color).view(1, 1, 3)
    pixels = (base + torch.randint(-40, 40, (size[1], size[0], 3), generator=g)).clamp(0, 255).to(torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, format="PNG")
    return buf.getvalue()


def image_batch(module, completion_lens: list[int], sizes: list[tuple[int, int]], group_size: int = 2,
                seed: int = 0) -> RolloutBatch:
    """A collected batch of image prompts built the way ``GRPOModule.collect`` builds one (records -> expanded
    prompts -> packed rows), with random completions of the given lengths and random advantages. Prompt ``p`` has
    the image of size ``sizes[p % len(sizes)]`` (unequal sizes: unequal image-token counts)."""
    from lightning_grpo.batch import pack_rollouts
    from lightning_grpo.collect.prompts import step_prompts
    from lightning_grpo.data.images import with_image_parts
    from lightning_grpo.data.prompts import PromptRecord
    from lightning_grpo.rollout.base import Rollout

    g = torch.Generator().manual_seed(seed)
    n_prompts = len(completion_lens) // group_size
    records = [PromptRecord(p, "what is it?", "red", {}, with_image_parts("what is it?", 1),
                            (png(sizes[p % len(sizes)], seed=seed + p),)) for p in range(n_prompts)]
    prompts, _ = step_prompts(records, module.tokenizer, module.vision)
    rollouts = [Rollout(prompts[i // group_size], torch.randint(4, 60, (n,), generator=g).tolist(), "", "length")
                for i, n in enumerate(completion_lens)]
    advantages, rewards = torch.randn(len(rollouts), generator=g), torch.rand(len(rollouts), generator=g)
    return pack_rollouts(rollouts, advantages, rewards, module.tokenizer.pad_token_id)


@contextlib.contextmanager
def output_norm_capture(module: torch.nn.Module):
    """A recorder's ``capture``: yields an object whose ``value`` is the L2 norm over the last axis of ``module``'s
    output (``[B, T]``) once the forward has run."""
    cap = type("Capture", (), {"value": None})()
    handle = module.register_forward_hook(lambda m, a, out: setattr(cap, "value", out.norm(dim=-1)))
    try:
        yield cap
    finally:
        handle.remove()
