"""lightning-grpo: GRPO for PyTorch Lightning (``lightning.pytorch``).

The supported public API is the names below, importable from the package itself::

    from lightning_grpo import GRPOModule, GRPOConfig, HandoffCallback, PromptDataModule

Each name is imported on first use (PEP 562 ``__getattr__``), so ``import lightning_grpo`` loads
neither torch nor Lightning, and the ``vllm`` package is imported only when a ``VLLMEngine`` is
built. Anything not listed here is internal and may change.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    # the module and its configuration (every field is a CLI/YAML key: docs/configuration.md)
    "GRPOModule": "lightning_grpo.module",
    "GRPOConfig": "lightning_grpo.config",
    "OptimConfig": "lightning_grpo.config",
    "RolloutConfig": "lightning_grpo.config",
    "ConfigError": "lightning_grpo.config",
    "PolicyConfig": "lightning_grpo.policy",
    "TinyPolicySpec": "lightning_grpo.tiny.spec",
    "load_policy": "lightning_grpo.policy",
    # data and rewards
    "PromptDataModule": "lightning_grpo.data.prompts",
    "PromptRecord": "lightning_grpo.data.prompts",
    "RewardSpec": "lightning_grpo.data.rewards",
    "RewardError": "lightning_grpo.data.rewards",
    "score": "lightning_grpo.data.rewards",
    # callbacks for a Trainer
    "HandoffCallback": "lightning_grpo.handoff",
    "GRPOCheckpoint": "lightning_grpo.checkpoint",
    "RunSummary": "lightning_grpo.summary",
    "GRPOProgressBar": "lightning_grpo.progress",
    "GRPORichProgressBar": "lightning_grpo.progress",
    # rollout engines behind one protocol
    "RolloutEngine": "lightning_grpo.rollout.base",
    "SamplingConfig": "lightning_grpo.rollout.base",
    "Prompt": "lightning_grpo.rollout.base",
    "Rollout": "lightning_grpo.rollout.base",
    "build_engine": "lightning_grpo.engines",
    "EngineParts": "lightning_grpo.engines",
    "HFEngine": "lightning_grpo.rollout.hf",
    "ReplayEngine": "lightning_grpo.rollout.replay",
    "VLLMEngine": "lightning_grpo.rollout.vllm",
    "VLLMConfig": "lightning_grpo.config",
    "ServerConfig": "lightning_grpo.config",
    "VLLMServerEngine": "lightning_grpo.rollout.vllm_server",
    # objectives: on-policy distillation (model.objective: opd) and DPO on the same accumulation
    "OPDConfig": "lightning_grpo.objectives.opd",
    "Objective": "lightning_grpo.objectives.base",
    "register_objective": "lightning_grpo.objectives",
    "DPOModule": "lightning_grpo.dpo",
    "DPOConfig": "lightning_grpo.dpo",
    "PreferenceDataModule": "lightning_grpo.data.preference_module",
    # entry points
    "GRPOCLI": "lightning_grpo.cli",
    "plot_curves": "lightning_grpo.plot",
}

__all__ = [
    "GRPOCLI",
    "ConfigError",
    "DPOConfig",
    "DPOModule",
    "EngineParts",
    "GRPOCheckpoint",
    "GRPOConfig",
    "GRPOModule",
    "GRPOProgressBar",
    "GRPORichProgressBar",
    "HFEngine",
    "HandoffCallback",
    "OPDConfig",
    "Objective",
    "OptimConfig",
    "PolicyConfig",
    "PreferenceDataModule",
    "Prompt",
    "PromptDataModule",
    "PromptRecord",
    "ReplayEngine",
    "RewardError",
    "RewardSpec",
    "Rollout",
    "RolloutConfig",
    "RolloutEngine",
    "RunSummary",
    "SamplingConfig",
    "ServerConfig",
    "TinyPolicySpec",
    "VLLMConfig",
    "VLLMEngine",
    "VLLMServerEngine",
    "build_engine",
    "load_policy",
    "plot_curves",
    "register_objective",
    "score",
]
"""The supported names (tests/test_public_api.py checks each imports)."""


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_grpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static analysers and IDEs see the real names
    from lightning_grpo.checkpoint import GRPOCheckpoint
    from lightning_grpo.cli import GRPOCLI
    from lightning_grpo.config import (
        ConfigError,
        GRPOConfig,
        OptimConfig,
        RolloutConfig,
        ServerConfig,
        VLLMConfig,
    )
    from lightning_grpo.data.preference_module import PreferenceDataModule
    from lightning_grpo.data.prompts import PromptDataModule, PromptRecord
    from lightning_grpo.data.rewards import RewardError, RewardSpec, score
    from lightning_grpo.dpo import DPOConfig, DPOModule
    from lightning_grpo.engines import EngineParts, build_engine
    from lightning_grpo.handoff import HandoffCallback
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.objectives import register_objective
    from lightning_grpo.objectives.base import Objective
    from lightning_grpo.objectives.opd import OPDConfig
    from lightning_grpo.plot import plot_curves
    from lightning_grpo.policy import PolicyConfig, load_policy
    from lightning_grpo.progress import GRPOProgressBar, GRPORichProgressBar
    from lightning_grpo.rollout.base import (
        Prompt,
        Rollout,
        RolloutEngine,
        SamplingConfig,
    )
    from lightning_grpo.rollout.hf import HFEngine
    from lightning_grpo.rollout.replay import ReplayEngine
    from lightning_grpo.rollout.vllm import VLLMEngine
    from lightning_grpo.rollout.vllm_server import VLLMServerEngine
    from lightning_grpo.summary import RunSummary
    from lightning_grpo.tiny.spec import TinyPolicySpec
