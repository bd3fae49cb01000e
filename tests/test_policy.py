"""Policies by Hub id (offline, from a populated Hub cache) or folder: model, tokenizer and chat template; a ``tiny:``
build (and its warm start) keyed on the seed it used."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import HUB_COMMIT, SMALL, cache_hub_model

from lightning_grpo import policy as policy_mod
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig, PolicyNotFoundError, load_policy, resolve_path, with_seed
from lightning_grpo.tiny.tokenizer import TINY_CHAT_TEMPLATE

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
    module = GRPOModule(policy=PolicyConfig(path="tiny-org/not-there"))
    with pytest.raises(PolicyNotFoundError, match="'tiny-org/not-there'"):
        module.configure_model()  # where Lightning builds the policy: setup, before the first step


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


@pytest.mark.slow
@pytest.mark.vllm
def test_fit_by_hub_id_offline_through_the_vllm_engine(tmp_path, tiny_chat_policy_dir):
    """`lightning-grpo fit --model.policy.path=<hub id>` with HF_HOME + HF_HUB_OFFLINE=1, as a user runs it: the
    trainer and the vLLM engine both load the cache's snapshot folder."""
    pytest.importorskip("vllm")
    snapshot = cache_hub_model(tmp_path / "hf" / "hub", REPO, tiny_chat_policy_dir)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_CACHE"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    cli = Path(sys.executable).parent / "lightning-grpo"
    args = [str(cli), "fit", f"--model.policy.path={REPO}", "--model.rollout.engine=vllm",
            "--model.rollout.vllm.dtype=float32", "--model.rollout.vllm.enforce_eager=true",
            "--model.rollout.vllm.max_model_len=256", "--model.rollout.vllm.kv_cache_memory_bytes=33554432",
            "--trainer.accelerator=cpu", "--trainer.max_steps=1", "--model.rl.batch_per_replica=4",
            "--model.rl.group_size=2", "--model.rollout.max_new_tokens=4", "--data.val_size=0",
            "--trainer.enable_checkpointing=false"]
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert f"model='{snapshot}'" in log  # vLLM's engine config names the snapshot folder the trainer loaded
    assert (tmp_path / "runs" / "lightning_logs" / "version_0" / "metrics.csv").exists()


def _module(seed: int | None, tiny=SMALL) -> GRPOModule:
    module = GRPOModule(policy=PolicyConfig(path="tiny:seeded", tiny=tiny), seed=seed)
    module.configure_model()  # builds the policy (what a Trainer does on each rank)
    return module


def test_a_tiny_policy_is_built_and_cached_per_module_seed():
    three, four, three_again = _module(3), _module(4), _module(3)
    assert (three.policy_cfg.tiny.seed, four.policy_cfg.tiny.seed) == (3, 4)
    folders = [resolve_path(m.policy_cfg) for m in (three, four, three_again)]
    assert folders[0] == folders[2] != folders[1]  # the engine (vLLM) loads the folder the module trained from
    weights = [dict(m.policy.named_parameters()) for m in (three, four, three_again)]
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # another init
    assert all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])


def test_an_explicit_tiny_seed_wins_and_folders_are_unchanged_outside_a_module():
    assert _module(3, tiny=replace(SMALL, seed=9)).policy_cfg.tiny.seed == 9
    unseeded = PolicyConfig(path="tiny:seeded", tiny=SMALL)
    assert resolve_path(unseeded) == resolve_path(with_seed(unseeded, 0))  # None outside a module = 0, as before
    folder_cfg = PolicyConfig(path="/some/folder")
    assert with_seed(folder_cfg, 5) is folder_cfg  # a real checkpoint has no init seed


def test_the_warm_start_is_cached_under_the_seed_it_used():
    cfg = PolicyConfig(path="tiny:warm", tiny=SMALL, warm_start="arith_small", warm_start_steps=2)
    five, six = resolve_path(with_seed(cfg, 5)), resolve_path(with_seed(cfg, 6))
    assert five != six and five.name.endswith("-warm-arith_small-2") and six.name.endswith("-warm-arith_small-2")
    assert five.name.replace("-5-", "-6-", 1) == six.name  # the seed is the only field of the key that differs
