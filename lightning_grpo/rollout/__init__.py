"""Rollout engines behind one protocol: transformers (default on CPU), vLLM, replay.

The package itself holds only the protocol and its data types (``base.py``), so any module can import
them; ``server/`` holds the ``vllm serve`` plumbing behind ``vllm_server.py``. Nothing here imports ``config.py``,
``policy.py``, ``vision.py`` or ``data/`` (``tests/test_layout.py``): ``lightning_grpo/engines.py``'s
``build_engine`` picks an engine by name and hands it its parts explicitly.
"""

from __future__ import annotations

from lightning_grpo.rollout.base import Prompt, Rollout, RolloutEngine, SamplingConfig

__all__ = ["Prompt", "Rollout", "RolloutEngine", "SamplingConfig"]
