"""The supported names import from the package itself, lazily: `import lightning_grpo` loads no heavy module."""

from __future__ import annotations

import subprocess
import sys

import pytest

import lightning_grpo

PROBE = """
import sys
import lightning_grpo
light = not any(m in sys.modules for m in ("torch", "lightning", "transformers"))
for name in lightning_grpo.__all__:
    getattr(lightning_grpo, name)
print(light, "vllm" in sys.modules)
"""


def test_exports_are_the_listed_names():
    assert sorted(lightning_grpo.__all__) == sorted(lightning_grpo._EXPORTS)
    assert set(lightning_grpo.__all__) <= set(dir(lightning_grpo))


@pytest.mark.heavy  # fresh interpreters: CI and `make test-integration`
def test_import_is_lazy_and_every_name_resolves_without_vllm():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]  # nothing heavy at import; all names resolve; vllm never imported


def test_names_are_the_implementations():
    from lightning_grpo.handoff import HandoffCallback
    from lightning_grpo.module import GRPOModule

    assert lightning_grpo.GRPOModule is GRPOModule and lightning_grpo.HandoffCallback is HandoffCallback
