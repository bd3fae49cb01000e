"""Rollout engines behind one protocol: transformers (default on CPU), vLLM, replay."""

from __future__ import annotations

from lightning_grpo.rollout.base import Prompt, Rollout, RolloutEngine, SamplingConfig

__all__ = ["Prompt", "Rollout", "RolloutEngine", "SamplingConfig", "build_engine"]


def build_engine(cfg, module) -> RolloutEngine:
    """The engine ``cfg.engine`` names, bound to ``module``'s policy and tokenizer."""
    if cfg.engine == "replay":
        from lightning_grpo.rollout.replay import ReplayEngine

        return ReplayEngine(cfg.replay_path, eos_token_id=module.tokenizer.eos_token_id)
    if cfg.engine == "hf":
        from lightning_grpo.rollout.hf import HFEngine

        return HFEngine(module.policy, module.tokenizer)
    if cfg.engine == "vllm":
        from lightning_grpo.policy import resolve_path
        from lightning_grpo.rollout.vllm import VLLMEngine

        return VLLMEngine(str(resolve_path(module.policy_cfg)), cfg.vllm)
    raise ValueError(f"rollout.engine={cfg.engine!r}: must be one of 'hf', 'vllm', 'replay'")
