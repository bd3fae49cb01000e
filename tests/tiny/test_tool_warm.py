"""The tool warm start (``tiny/tool_warm.py``): scripted calculator episodes recorded by the rollout's episode path,
trained on the model's turns only, in the format the shipped tools quickstart parses."""

from pathlib import Path

import pytest
import torch
import yaml

from lightning_grpo.envs import EpisodeRunner
from lightning_grpo.rollout.base import Prompt, SamplingConfig
from lightning_grpo.tiny.tool_warm import (
    TOOL_EPISODES,
    TOOL_STOP,
    TOOL_TASK,
    ScriptedTurns,
    calculator_script,
    episode_rows,
    guess_script,
    warm_start_tools,
)

CONFIG = Path(__file__).parents[2] / "configs" / "tools-quickstart.yaml"


@pytest.fixture(scope="module")
def tokenizer():
    from lightning_grpo.tiny.tokenizer import TINY_CHAT_TEMPLATE, make_char_tokenizer

    tok = make_char_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def play(tokenizer, share: float, pairs: list[tuple[int, int]], seed: int = 0, script=calculator_script):
    runner = EpisodeRunner(TOOL_EPISODES, tokenizer, [tokenizer.eos_token_id])
    prompts = [Prompt(i, [], f"{a}+{b}=", str(a + b), {"a": a, "b": b}, [{"role": "user", "content": f"{a}+{b}="}])
               for i, (a, b) in enumerate(pairs)]
    return runner.play(ScriptedTurns(tokenizer, script(share, seed)), prompts, 1,
                       SamplingConfig(max_new_tokens=64, stop=TOOL_STOP))


def test_a_scripted_tool_episode_is_the_runs_record_and_only_model_turns_are_labelled(tokenizer):
    episodes, metrics = play(tokenizer, 1.0, [(12, 345)])
    (e,) = episodes
    assert e.reward == 1.0 and metrics["tools/call_frequency"] == 2 and metrics["tools/failure_frequency"] == 0
    ids, mask, labels = episode_rows(episodes, tokenizer.pad_token_id)
    text = tokenizer.decode(ids[0][mask[0]])
    assert text == ("user: 12+345=\nassistant: add(a=12, b=345)\ntool: 357\nassistant: submit(answer=357)\n"
                    "tool: submitted\nassistant: <eos>")
    # the turns end on the stop string's token (kept, as the engines keep it); tool results are context
    turns = [tokenizer.decode(labels[0][i: i + 1]) for i in range(labels.shape[1]) if labels[0, i] != -100]
    assert "".join(turns) == "add(a=12, b=345)submit(answer=357)<eos>"
    assert labels[0, : len(e.prompt.token_ids)].eq(-100).all()


@pytest.mark.heavy  # a warm start: CI and `make test-integration`
def test_the_first_stage_answers_without_the_tool_in_share_of_the_episodes(tokenizer):
    pairs = [(i * 7 % 1000, i * 13 % 1000) for i in range(400)]
    episodes, metrics = play(tokenizer, 0.5, pairs)
    tool = [e for e in episodes if e.model_mask.count(False)]  # tool results in the record
    assert 0.4 < len(tool) / len(episodes) < 0.6, len(tool)
    assert all(e.reward == 1.0 for e in tool)
    direct = [e for e in episodes if e not in tool]
    assert all(e.reward == 0.0 and e.text.isdigit() and e.token_ids[-1] == tokenizer.eos_token_id for e in direct)
    assert metrics["tools/call_frequency"] == pytest.approx(2 * len(tool) / len(episodes))
    assert [e.model_mask for e in play(tokenizer, 0.5, pairs, seed=1)[0]] != [e.model_mask for e in episodes]


def test_the_settling_stage_submits_a_guess_without_the_tool_in_the_other_episodes(tokenizer):
    pairs = [(i * 7 % 1000, i * 13 % 1000) for i in range(400)]
    episodes, metrics = play(tokenizer, 0.35, pairs, script=guess_script)
    tool = [e for e in episodes if e.transcript.turns[0].text.startswith("add(")]
    assert 0.25 < len(tool) / len(episodes) < 0.45, len(tool)
    assert all(e.reward == 1.0 for e in tool)
    direct = [e for e in episodes if e not in tool]
    # the add skipped: submit a guess at once (never the sum), then end the episode
    for e in direct:
        assert e.transcript.turns[0].text.startswith("submit(answer=") and e.reward == 0.0
        assert len(e.transcript.turns) == 2 and e.token_ids[-1] == tokenizer.eos_token_id
    assert metrics["tools/call_frequency"] == pytest.approx((2 * len(tool) + len(direct)) / len(episodes))
    again = play(tokenizer, 0.35, pairs, seed=1, script=guess_script)[0]
    assert [e.model_mask for e in again] != [e.model_mask for e in episodes]


def test_the_warm_start_plays_the_shipped_quickstarts_episodes():
    cfg = yaml.safe_load(CONFIG.read_text())
    model = cfg["model"]
    assert model["policy"]["warm_start"] == TOOL_TASK and cfg["data"]["source"] == f"builtin:{TOOL_TASK}"
    assert {k: getattr(TOOL_EPISODES, k) for k in model["env"]} == model["env"]
    assert tuple(model["rollout"]["stop"]) == TOOL_STOP


def test_warm_start_tools_trains_the_model_turns(tiny_chat_policy_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(tiny_chat_policy_dir), AutoTokenizer.from_pretrained(
        tiny_chat_policy_dir)
    before = [p.detach().clone() for p in model.parameters()]
    first = warm_start_tools(model, tok, steps=1, batch_size=8)
    result = warm_start_tools(model, tok, steps=20, batch_size=8, seed=1, settle=5)  # 15 steps, then 5 settling
    assert result.steps == 20 and result.loss < first.loss
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


class _Logits(torch.nn.Module):
    """A model ``sft`` can train: logits from an embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 5)

    def forward(self, input_ids, attention_mask):
        return type("Out", (), {"logits": self.emb(input_ids)})()


@pytest.mark.parametrize(("cooldown", "expected"), [(0, [1.0] * 6), (3, [1.0, 1.0, 1.0, 1.0, 2 / 3, 1 / 3])])
def test_the_cooldown_decays_the_lr_over_the_last_steps(monkeypatch, cooldown, expected):
    from lightning_grpo.tiny.sft import sft

    seen = []
    step = torch.optim.AdamW.step

    def record(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", record)
    ids = torch.tensor([[1, 2, 3]])
    sft(_Logits(), 6, 0, 0.5, lambda s: (ids, torch.ones_like(ids), ids, {}), cooldown=cooldown)
    # step 1..6 of 6: constant, then linear towards 0 over the last `cooldown` steps
    assert seen == pytest.approx([0.5 * e for e in expected])
