"""Rollout engines behind one protocol: transformers (default on CPU), vLLM, replay.

The package itself holds only the protocol and its data types (``base.py``), so any module can import
them; ``build.py``'s ``build_engine`` picks an engine by name and imports the engines (and the policy).
"""

from __future__ import annotations

from lightning_grpo.rollout.base import Prompt, Rollout, RolloutEngine, SamplingConfig

__all__ = ["Prompt", "Rollout", "RolloutEngine", "SamplingConfig"]
