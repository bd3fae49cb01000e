"""Prompts as users have them: chat messages through the chat template, plain strings as they are, long prompts."""

from __future__ import annotations

import json
import warnings

import pytest
from helpers import SMALL, SMALL_CHAT
from lightning.pytorch import Trainer

from lightning_grpo.config import GRPOConfig, RolloutConfig
from lightning_grpo.data.chat import ChatTemplateError, encode, encode_prompt, fit_items
from lightning_grpo.data.items import TaskItem
from lightning_grpo.data.prompts import PromptDataModule, PromptRecord
from lightning_grpo.data.rewards import RewardSpec
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig, load_policy

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3="}]


def test_encode_prompt_is_plain_characters(tiny_policy_dir):
    _, tok = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    assert tok.convert_ids_to_tokens(encode_prompt(tok, "12+3=")) == list("12+3=")


def test_chat_prompts_go_through_the_chat_template(tiny_chat_policy_dir):
    _, tok = load_policy(PolicyConfig(path=str(tiny_chat_policy_dir)))
    ids, text = encode(tok, "2+3=", MESSAGES)
    assert text == "system: be brief\nuser: 2+3=\nassistant: "  # add_generation_prompt=True
    assert tok.decode(ids) == text
    plain_ids, plain = encode(tok, "2+3=", None)
    assert plain == "2+3=" and tok.decode(plain_ids) == "2+3="  # plain strings stay plain
    prompt = PromptRecord(3, "2+3=", "5", {"answer": "5"}, MESSAGES).to_prompt(tok)
    assert prompt.text == text and prompt.messages == MESSAGES and prompt.token_ids == ids


def test_chat_prompts_and_a_tokenizer_without_a_chat_template(tiny_policy_dir):
    _, tok = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    with pytest.raises(ChatTemplateError, match=r"^prompt: the prompts are chat messages but the policy's tokenizer "
                                                r"has no chat template\. .*policy.chat_template"):
        encode(tok, "", MESSAGES)


def test_fit_items_drops_or_refuses_long_prompts(tiny_policy_dir):
    _, tok = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    items = [TaskItem("1+1=", "2"), TaskItem("9" * 40 + "=", "0"), TaskItem("2+2=", "4")]
    with pytest.warns(UserWarning, match=r"src: dropped 1 of 3 prompts longer than rollout.max_prompt_tokens=8 "
                                         r"\(first: row 1, 41 tokens\)"):
        kept, rows = fit_items(items, tok, 8, "drop", "src")
    assert [it.text for it in kept] == ["1+1=", "2+2="] and rows == [0, 2]
    with pytest.raises(ValueError, match=r"src: 1 of 3 prompts are longer than rollout.max_prompt_tokens=8"):
        fit_items(items, tok, 8, "error", "src")
    assert fit_items(items, tok, None, "error", "src")[1] == [0, 1, 2]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def fit(policy: PolicyConfig, source: str, tmp_path, rollout: RolloutConfig | None = None, steps: int = 1,
        rewards=("reward_fns:trl_exact",)):
    module = GRPOModule(policy=policy, rl=GRPOConfig(batch_per_replica=4, group_size=2),
                        rollout=rollout or RolloutConfig(max_new_tokens=2),
                        rewards=[RewardSpec(r) for r in rewards])
    trainer = Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=PromptDataModule(source, val_size=0))
    return module, trainer


def test_a_chat_dataset_trains_with_a_chat_model(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(6)]
    module, trainer = fit(PolicyConfig(path="tiny:chat", tiny=SMALL_CHAT), write_jsonl(tmp_path / "c.jsonl", rows),
                          tmp_path, rewards=("reward_fns:trl_chat",))
    assert trainer.global_step == 1
    assert module.last_metrics["reward/reward_fns:trl_chat"] == 1.0  # chat-message prompts and completions
    assert module.last_metrics["data/long_prompts_dropped"] == 0.0


def test_chat_prompts_for_a_tokenizer_without_a_template_fail_at_setup(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(6)]
    with pytest.raises(ChatTemplateError) as e:
        fit(PolicyConfig(path="tiny:plain", tiny=SMALL), write_jsonl(tmp_path / "c.jsonl", rows), tmp_path)
    assert str(e.value).startswith(f"data.source='{tmp_path / 'c.jsonl'}': the prompts are chat messages but the "
                                   "policy's tokenizer has no chat template")


def test_one_long_prompt_never_aborts_a_run(tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
    rows.insert(2, {"prompt": "1+" * 200 + "1=", "answer": "201"})  # 402 tokens: over the 256-token context
    source = write_jsonl(tmp_path / "long.jsonl", rows)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module, trainer = fit(PolicyConfig(path="tiny:plain", tiny=SMALL), source, tmp_path, steps=3)
    assert trainer.global_step == 3 and module.last_metrics["data/long_prompts_dropped"] == 1.0
    dropped = [w for w in seen if "longer than rollout.max_prompt_tokens" in str(w.message)]
    assert len(dropped) == 1 and "max_prompt_tokens=254 (first: row 2, 402 tokens)" in str(dropped[0].message)
    with pytest.raises(ValueError, match=r"1 of 6 prompts are longer than rollout.max_prompt_tokens=20"):
        fit(PolicyConfig(path="tiny:plain", tiny=SMALL), source, tmp_path,
            rollout=RolloutConfig(max_new_tokens=2, max_prompt_tokens=20, long_prompts="error"))
