"""Whether vLLM can load the policy's model class is checked before an engine starts, and a failure says why."""

import importlib.util
import json

import pytest

from lightning_grpo.rollout.vllm_loadable import EngineCannotLoadError, check_vllm_can_load, vllm_model_modules

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


@pytest.fixture
def registered(monkeypatch):
    """Register architectures in vLLM's registry for one test (removed afterwards)."""
    pytest.importorskip("vllm")
    from vllm.model_executor.models.registry import ModelRegistry

    monkeypatch.setattr(ModelRegistry, "models", dict(ModelRegistry.models))
    return ModelRegistry.register_model


def folder_of(tmp_path, *archs):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": list(archs)}))
    return tmp_path


def test_a_missing_package_is_named_with_the_fix(tmp_path, registered):
    registered("NoSuchPkgForCausalLM", "no_such_pkg_xyz.models:Model")
    with pytest.raises(EngineCannotLoadError) as err:
        check_vllm_can_load(folder_of(tmp_path, "NoSuchPkgForCausalLM"))
    message = str(err.value)
    assert "NoSuchPkgForCausalLM" in message and "imports no_such_pkg_xyz, which is not installed" in message
    assert "Fix: install no_such_pkg_xyz" in message and "--model.rollout.engine=hf" in message
    assert 2 <= len(message.splitlines()) <= 6


def test_a_broken_module_is_not_called_missing(tmp_path, registered, monkeypatch):
    """An installed module whose import fails (a version mismatch) gets no install advice."""
    (tmp_path / "broken_model_xyz.py").write_text("from json import no_such_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registered("BrokenForCausalLM", "broken_model_xyz:Model")
    with pytest.raises(EngineCannotLoadError) as err:
        check_vllm_can_load(folder_of(tmp_path, "BrokenForCausalLM"))
    assert "importing its module broken_model_xyz failed" in str(err.value) and "no_such_name" in str(err.value)
    assert "not installed" not in str(err.value)


def test_the_tiny_policies_resolve_to_vllm_modules(tiny_policy_dir, tiny_vlm_dir):
    pytest.importorskip("vllm")
    check_vllm_can_load(tiny_policy_dir)  # Qwen2: loads here
    assert vllm_model_modules(tiny_vlm_dir) == [("Qwen2_5_VLForConditionalGeneration",
                                                 "vllm.model_executor.models.qwen2_5_vl")]
    if importlib.util.find_spec("torchvision") is None:
        with pytest.raises(EngineCannotLoadError, match="imports torchvision, which is not installed"):
            check_vllm_can_load(tiny_vlm_dir)
