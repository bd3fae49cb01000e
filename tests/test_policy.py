"""Policies by Hub id (offline, from a populated Hub cache) or folder: model, tokenizer and chat template."""

from __future__ import annotations

import pytest
from helpers import HUB_COMMIT, cache_hub_model

from lightning_grpo import policy as policy_mod
from lightning_grpo.policy import TINY_CHAT_TEMPLATE, PolicyConfig, PolicyNotFoundError, load_policy, resolve_path

REPO = "tiny-org/tiny-chat"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_chat_policy_dir):
    """A Hub cache holding ``REPO`` (HF_HUB_OFFLINE=1 comes from conftest), and a fresh snapshot memo."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache_hub_model(cache, REPO, tiny_chat_policy_dir)
    assert constants.HF_HUB_OFFLINE
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(policy_mod, "_SNAPSHOTS", {})
    return cache


def test_a_hub_id_loads_offline_from_the_hub_cache(hub_cache):
    snapshot = hub_cache / "models--tiny-org--tiny-chat" / "snapshots" / HUB_COMMIT
    cfg = PolicyConfig(path=REPO)
    assert resolve_path(cfg) == snapshot
    model, tok = load_policy(cfg)
    assert tok.chat_template == TINY_CHAT_TEMPLATE  # tokenizer and chat template from the same snapshot
    assert model.config.hidden_size == 64
    assert resolve_path(PolicyConfig(path=REPO, revision=HUB_COMMIT)) == snapshot  # a commit, not only refs/main


def test_a_hub_id_not_in_the_cache_is_a_short_error_naming_the_id_and_the_fix(hub_cache):
    with pytest.raises(PolicyNotFoundError) as e:
        load_policy(PolicyConfig(path="Qwen/Qwen2.5-0.5B-Instruct"))
    first = str(e.value).splitlines()[0]
    assert first.startswith("policy.path='Qwen/Qwen2.5-0.5B-Instruct': not a local folder, and Hub model "
                            "'Qwen/Qwen2.5-0.5B-Instruct' (revision main) is not in the Hub cache")
    assert "HF_HUB_OFFLINE=1" in first and "hf download Qwen/Qwen2.5-0.5B-Instruct" in first
    with pytest.raises(PolicyNotFoundError, match=r"\(revision v9\) is not in the Hub cache"):
        resolve_path(PolicyConfig(path=REPO, revision="v9"))


def test_the_module_reports_a_missing_model_before_anything_trains(hub_cache):
    from lightning_grpo.module import GRPOModule

    with pytest.raises(PolicyNotFoundError, match="'tiny-org/not-there'"):
        GRPOModule(policy=PolicyConfig(path="tiny-org/not-there"))


def test_neither_folder_nor_hub_id():
    with pytest.raises(PolicyNotFoundError, match=r"policy.path='./no/such dir' is neither a local folder nor a "
                                                  r"Hugging Face Hub id"):
        resolve_path(PolicyConfig(path="./no/such dir"))


def test_attn_implementation_and_chat_template_override(tiny_policy_dir, tmp_path):
    model, tok = load_policy(PolicyConfig(path=str(tiny_policy_dir), attn_implementation="eager"))
    assert model.config._attn_implementation == "eager" and not tok.chat_template
    _, tok = load_policy(PolicyConfig(path=str(tiny_policy_dir), chat_template=TINY_CHAT_TEMPLATE))
    assert tok.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True,
                                   tokenize=False) == "user: 1+1=\nassistant: "
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    _, tok = load_policy(PolicyConfig(path=str(tiny_policy_dir), chat_template=str(tmp_path / "t.jinja")))
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False) == "ab"
