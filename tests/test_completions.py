"""Completions a person can read: completions.jsonl in the run folder (appended), a W&B Table, a console line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import wandb
from helpers import fit_tiny, tiny_grpo_module
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from lightning_grpo.collect.rows import RewardParts, StepRows, TokenFigure
from lightning_grpo.completions import COLUMNS, EPISODE_COLUMNS, CompletionLog, format_sample
from lightning_grpo.rollout.base import Prompt, Rollout, Transcript, Turn


def _rows(n_groups: int = 3, group_size: int = 2) -> StepRows:
    rollouts = [Rollout(Prompt(id=g, token_ids=[1], text=f"{g}+1="), [2], f"c{g}.{j}", "stop")
                for g in range(n_groups) for j in range(group_size)]
    parts = RewardParts()
    parts.add(rollouts, {"arith": torch.arange(len(rollouts), dtype=torch.float32)})
    rewards = torch.arange(len(rollouts), dtype=torch.float32) * 2
    return StepRows(7, rollouts, rewards, rewards - 1, parts)


def test_samples_spread_over_groups_and_carry_every_field():
    samples = _rows().samples(4, group_size=2)
    assert [s["completion"] for s in samples] == ["c0.0", "c1.0", "c2.0", "c0.1"]  # one per group first
    assert samples[1] == {"step": 7, "prompt_id": 1, "prompt": "1+1=", "completion": "c1.0", "reward": 4.0,
                          "rewards": {"arith": 2.0}, "advantage": 3.0, "finish_reason": "stop", "trained": True}
    assert set(samples[0]) == set(COLUMNS)
    assert format_sample(samples[1]) == ("[completion, loop step 7] '1+1=' -> 'c1.0' (stop)\n"
                                         "  reward 4.000 (arith 2.000), advantage +3.000")


def episode_rows() -> StepRows:
    """One calculator episode as ``envs/episode.py`` records it: a call, its result, the answer; a padding row."""
    turns = (Turn('<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>', 12,
                  ({"name": "add", "arguments": {"a": 3, "b": 4}, "result": "7", "failed": False},), 9),
             Turn('<tool_call>{"name": "submit", "arguments": {"answer": 7}}</tool_call><tool_call>{"nam', 14,
                  ({"name": "submit", "arguments": {"answer": 7}, "result": None, "failed": False},
                   {"name": "error", "arguments": None, "result": "Error: bad JSON", "failed": True})))
    opening = "<|im_start|>system\nTools:\n{\"name\": \"add\"}<|im_end|>\n<|im_start|>user\n3+4=<|im_end|>\n"
    prompt = Prompt(id=5, token_ids=[1], text="3+4=")
    rollouts = [Rollout(prompt, [2] * 35, "", "length", reward=1.0, model_mask=[True] * 26 + [False] * 9,
                        transcript=Transcript(opening, turns)) for _ in range(2)]
    parts = RewardParts()
    parts.add(rollouts, {"environment": torch.tensor([1.0, 1.0])})
    rewards = torch.tensor([1.0, 1.0])
    return StepRows(3, rollouts, rewards, rewards * 0, parts, trained=torch.tensor([True, False]))


def test_an_episode_row_holds_the_prompt_the_model_saw_every_turn_and_the_reward_parts():
    first, padding = episode_rows().samples(2, group_size=2)
    assert first["prompt"].startswith("<|im_start|>system\nTools:") and first["completion"] == ""
    assert first["rewards"] == {"environment": 1.0} and (first["trained"], padding["trained"]) == (True, False)
    assert [t["calls"][0]["name"] for t in first["turns"]] == ["add", "submit"]
    assert first["turns"][0]["calls"][0]["arguments"] == {"a": 3, "b": 4} and first["turns"][0]["context_tokens"] == 9
    assert set(first) == set(EPISODE_COLUMNS)
    json.dumps(first)  # a completions.jsonl line
    text = format_sample(first)
    assert text.splitlines()[0] == ("[episode, loop step 3, prompt 5] length, 2 turn(s); reward 1.000 "
                                    "(environment 1.000), advantage +0.000")
    assert "  | Tools:" in text  # the tool schema, as the model read it
    assert "  call add(a=3, b=4) -> '7'" in text and "+ 9 tokens of tool results (context, not trained)" in text
    assert "call submit(answer=7): not run (the episode ended first)" in text
    assert "  unreadable call -> 'Error: bad JSON' (failed)" in text
    assert "(14 tokens, not trained: the row left the loss)" in format_sample(padding)


def test_an_opd_row_shows_the_per_token_kl_and_no_advantage():
    rows = _rows()
    figure = TokenFigure("kl_to_teacher", lambda rollouts: [[0.5, 0.25]] * len(rollouts))
    sample = replace(rows, figure=figure, uses_advantages=False).samples(1, group_size=2)[0]
    assert sample["advantage"] is None and sample["kl_to_teacher"] == [0.5, 0.25]
    assert format_sample(sample).splitlines()[1] == ("  reward 0.000 (arith 0.000), kl_to_teacher per token "
                                                     "[0.500 0.250] (mean 0.375)")


def test_bad_arguments_are_refused_naming_the_call():
    with pytest.raises(ValueError, match=r"CompletionLog\(samples_per_step=-1"):
        CompletionLog(samples_per_step=-1)


@pytest.mark.slow
def test_every_loop_step_appends_its_samples_and_the_console_shows_one(tiny_policy_dir, tmp_path, capsys):
    """A file already in the run folder (a run resumed into it) keeps its lines: the log appends."""
    logger = CSVLogger(tmp_path, name="run", version=0)
    path = tmp_path / "run" / "version_0" / "completions.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text('{"step": 0, "earlier": true}\n')
    fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path, loop_steps=2, logger=logger,
             callbacks=[CompletionLog(samples_per_step=3, log_completions_every=2)])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"step": 0, "earlier": True}
    assert [r["step"] for r in lines[1:]] == [1, 1, 1, 2, 2, 2]
    row = lines[1]
    assert set(row["rewards"]) == {"helpers:digit_share"} and row["prompt"] and isinstance(row["completion"], str)
    assert row["reward"] == pytest.approx(row["rewards"]["helpers:digit_share"])  # one function of weight 1
    out = capsys.readouterr().out
    assert out.count("[completion, loop step") == 1 and "[completion, loop step 2]" in out  # every 2nd step


@pytest.mark.slow
def test_a_wandb_logger_gets_a_completions_table(tiny_policy_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="t")
    fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path, loop_steps=1, logger=logger,
             callbacks=[CompletionLog(samples_per_step=2)])
    logger.experiment.finish()
    wandb.teardown()  # stop this process's wandb service (it would outlive the test in WANDB_SERVICE)
    tables = list(tmp_path.rglob("completions_*.table.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert table["columns"] == list(COLUMNS) and len(table["data"]) == 2
    assert len((tmp_path / "completions.jsonl").read_text().splitlines()) == 2  # W&B alone: its save_dir


@pytest.mark.slow
def test_the_cli_writes_completions_beside_the_metrics(quickstart_run):
    """`lightning-grpo fit` adds CompletionLog: 4 samples per loop step in the run folder, steps as metrics.csv's."""
    rows = [json.loads(line) for line in (quickstart_run.log_dir / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4
    assert all(set(r["rewards"]) == {"arith"} for r in rows)
