"""``build_engine``: the rollout engine ``rollout.engine`` names, bound to a module's policy and tokenizer.

Kept out of ``rollout/__init__.py``: it imports the engines and ``policy.py``, which themselves build on
``rollout.base``, and anything importing ``rollout.base`` runs the package's ``__init__`` first.
"""

from __future__ import annotations

import os
from dataclasses import replace

from lightning_grpo.config import ServerConfig, VLLMConfig
from lightning_grpo.policy import resolve_path
from lightning_grpo.rollout import adapter_sync
from lightning_grpo.rollout.base import RolloutEngine
from lightning_grpo.rollout.hf import HFEngine
from lightning_grpo.rollout.replay import ReplayEngine
from lightning_grpo.rollout.vllm_loadable import check_vllm_can_load


def build_engine(cfg, module, will_sleep: bool = True) -> RolloutEngine:
    """The engine ``cfg.engine`` names, bound to ``module``'s policy and tokenizer.

    ``will_sleep=False`` (nothing will put the engine to sleep: ``colocated_offload=false``, disaggregated, or
    no hand-off at all) builds a vLLM engine without sleep mode, which then reserves no memory for it, unless
    ``vllm.enable_sleep_mode`` is set explicitly. ``cfg`` itself is never changed.
    """
    if cfg.engine == "replay":
        return ReplayEngine(cfg.replay_path, eos_token_id=module.tokenizer.eos_token_id,
                            need_logprobs=f"rl.rollout_correction.mode={module.rl.rollout_correction.mode!r}"
                            if module.rl.needs_sampler_logprobs else None)
    if cfg.engine == "hf":
        return HFEngine(module.policy, module.tokenizer, vision=getattr(module, "vision", None))
    if cfg.engine == "vllm":
        # Deferred: `import lightning_grpo.rollout.build` (every GRPOModule does) never loads the vLLM engine module
        # unless a vLLM engine is built. No cycle: rollout.vllm imports nothing that imports this module.
        from lightning_grpo.rollout.vllm import VLLMEngine

        vllm = cfg.vllm or VLLMConfig()
        if vllm.enable_sleep_mode is None and not will_sleep:  # an explicit choice is the user's
            vllm = replace(vllm, enable_sleep_mode=False)
        if vllm.distributed_executor_backend == "external_launcher" and module._trainer is not None:
            # vLLM's torchrun-style launcher reads RANK and LOCAL_RANK; Lightning's own launcher and SLURM set neither
            os.environ.setdefault("RANK", str(module.global_rank))
            os.environ.setdefault("LOCAL_RANK", str(module.local_rank))
        path = resolve_path(module.policy_cfg)
        check_vllm_can_load(path)  # a missing package named in 3 lines, not a pydantic error from inside LLM()
        lora = module.policy_cfg.lora
        rank = lora.rank if lora is not None and lora.sync == "adapter" else None  # merge: a plain engine
        return VLLMEngine(str(path), vllm,
                          sampler_logprobs=module.rl.needs_sampler_logprobs, lora_rank=rank)
    if cfg.engine == "vllm_server":
        return _server_engine(cfg, module)
    raise ValueError(f"rollout.engine={cfg.engine!r}: must be one of 'hf', 'vllm', 'vllm_server', 'replay'")


def _server_engine(cfg, module) -> RolloutEngine:
    """A ``vllm serve`` engine whose syncs are checked against the policy's own logprobs (the probe)."""
    from lightning_grpo.rollout.server_ranks import Ranks
    from lightning_grpo.rollout.vllm_server import VLLMServerEngine, sequence_logprobs

    tokenizer, server, ranks = module.tokenizer, cfg.server or ServerConfig(), Ranks.current()
    if server.url is None and server.launch:  # the child runs this Python's vLLM
        check_vllm_can_load(resolve_path(module.policy_cfg), "vllm_server")

    adapter = module.policy_cfg.lora is not None and module.policy_cfg.lora.sync == "adapter"

    def republish() -> None:  # what the hand-off pushes once per collected batch, for a restarted server
        adapter_sync.publish_policy(module.policy, engine, int(cfg.sync_bucket_mb * (1 << 20)))

    engine = VLLMServerEngine(str(resolve_path(module.policy_cfg)), server,
                              reference=lambda ids: sequence_logprobs(module.policy, ids),
                              decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                              sampler_logprobs=module.rl.needs_sampler_logprobs, ranks=ranks, republish=republish,
                              lora_rank=module.policy_cfg.lora.rank if adapter else None)
    return engine
