"""The Collector on its own: a fake engine, hand-written rewards, no Lightning, no model (unit tier).

Each test checks one rule of a rollout against values written by hand: group advantages, the rows a skipped
record leaves, dynamic sampling's refill order, the per-rank seed, and that a new batch metric is one entry in
``collect/shaping.py`` (the docs/collect.md example).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lightning_grpo.collect import Collector, Drawer, RewardScorer, StepSampling, shaping
from lightning_grpo.config import GRPOConfig
from lightning_grpo.data.seam import PromptProvider
from lightning_grpo.data.stream import PromptRecord
from lightning_grpo.rollout.base import Rollout
from lightning_grpo.tiny.tokenizer import make_char_tokenizer

GROUP = 2


class CountingEngine:
    """Completion ``k`` of a prompt is ``k + 1`` copies of the prompt's last digit (deterministic, seedless)."""

    def __init__(self) -> None:
        self.calls = []

    def generate(self, prompts, group_size, sampling):
        self.calls.append(([p.id for p in prompts], group_size, sampling))
        out = []
        for p in prompts:
            for k in range(group_size):
                ids = [p.token_ids[-1]] * (k + 1)
                out.append(Rollout(p, ids, str(k + 1), "stop"))
        return out


def reward_by_id(rollouts):
    """Prompt ``id`` decides: an even id's group gets rewards (1, 0), an odd id's (1, 1) (a flat group)."""
    values = []
    for r in rollouts:
        flat = r.prompt.id % 2 == 1
        values.append(1.0 if flat or r.text == "1" else 0.0)
    return torch.tensor(values), {}


class Refills(PromptProvider):
    """A prompt provider whose refill rounds bring the ids 100, 101, ... (one record per round)."""

    def __init__(self) -> None:
        self.rounds = 0

    def refill_records(self):
        self.rounds += 1
        return [record(98 + 2 * self.rounds)]


def record(i: int) -> PromptRecord:
    return PromptRecord(i, f"{i % 10}+1=", "x", {})


def collector(rl: GRPOConfig, engine=None, prompts=None) -> Collector:
    tokenizer = make_char_tokenizer()
    sampling = StepSampling(8, 1.0, 1.0, 0, (), False, seed=3, world=2, rank=1)
    return Collector(Drawer(engine or CountingEngine(), None), reward_by_id, rl=rl, max_new_tokens=8,
                     sampling=sampling, tokenizer=tokenizer, prompts=prompts)


def test_advantages_are_normalized_per_group_and_rows_keep_the_draw_order():
    rl = GRPOConfig(batch_per_replica=4, group_size=GROUP, micro_batch_per_replica=4)
    batch, metrics = collector(rl).collect([record(0), record(2)], loop_step=0)
    # each group's rewards are (1, 0): mean 0.5, std (unbiased) 0.7071 -> advantages +-0.7071
    expected = torch.tensor([1.0, -1.0, 1.0, -1.0]) * 0.5 / (0.5**0.5 + 1e-4)
    assert torch.allclose(batch.advantages, expected, atol=1e-6)
    assert batch.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert batch.completion_mask.sum(-1).tolist() == [1, 2, 1, 2]  # completion k holds k + 1 tokens
    assert metrics["data/bad_records_skipped"] == 0.0


def test_the_last_rows_are_what_the_completions_log_writes():
    rl = GRPOConfig(batch_per_replica=4, group_size=GROUP, micro_batch_per_replica=4)
    c = collector(rl)
    c.collect([record(0), record(2)], loop_step=4)
    first, second = c.last_rows.samples(2, GROUP)
    assert (first["step"], first["prompt_id"], second["prompt_id"]) == (5, 0, 2)  # one row of each group first
    assert first["rewards"] == {} and first["advantage"] > 0  # a plain scoring callable shows no parts


def test_the_seed_is_one_per_run_seed_loop_step_and_rank():
    engine = CountingEngine()
    rl = GRPOConfig(batch_per_replica=2, group_size=GROUP, micro_batch_per_replica=2)
    collector(rl, engine).collect([record(0)], loop_step=5)
    (_, _, sampling), = engine.calls
    assert sampling.seed == (3 * 1_000_003 + 5) * 2 + 1


def test_dynamic_sampling_refills_flat_groups_from_the_refill_lane_in_draw_order():
    """Group 1 (odd id) is flat: dropped; one refill round brings id 100 (informative), which takes its place."""
    rl = GRPOConfig(batch_per_replica=4, group_size=GROUP, micro_batch_per_replica=4, dynamic_sampling=True,
                    max_refill_rounds=2)
    provider = Refills()
    batch, metrics = collector(rl, prompts=provider).collect([record(0), record(1)], loop_step=0)
    assert batch.group_ids.tolist() == [0, 0, 100, 100]
    assert provider.rounds == 1
    assert metrics["data/dynamic_groups_dropped"] == 1.0 and metrics["data/dynamic_refill_rounds"] == 1.0


def test_a_batch_still_short_pads_with_a_dropped_group_that_counts_in_no_divisor():
    rl = GRPOConfig(batch_per_replica=4, group_size=GROUP, micro_batch_per_replica=4, dynamic_sampling=True,
                    max_refill_rounds=0)
    with pytest.warns(UserWarning, match="short over all ranks"):
        batch, _ = collector(rl, prompts=Refills()).collect([record(0), record(1)], loop_step=0)
    assert batch.completion_mask.any(-1).tolist() == [True, True, False, False]
    assert batch.advantages[2:].tolist() == [0.0, 0.0]


class LongFlatEngine(CountingEngine):
    """As ``CountingEngine``, but an odd id's completions (the flat groups) are 7 tokens longer."""

    def generate(self, prompts, group_size, sampling):
        out = super().generate(prompts, group_size, sampling)
        longer = []
        for r in out:
            extra = 7 * (r.prompt.id % 2)
            longer.append(Rollout(r.prompt, r.token_ids + [r.token_ids[0]] * extra, r.text, "stop"))
        return longer


def test_a_short_batch_describes_its_trained_rows_not_its_padding():
    """Lengths 1, 2 trained (id 0) and 8, 9 padding (id 1, flat, both penalized -1: max_new_tokens 8, buffer 4):
    the padding must not enter the means (main: len_mean 5.0, penalty mean -0.5, len_max 9)."""
    rl = GRPOConfig(batch_per_replica=4, group_size=GROUP, micro_batch_per_replica=4, dynamic_sampling=True,
                    max_refill_rounds=0, overlong_buffer=4, overlong_penalty=1.0)
    with pytest.warns(UserWarning, match="short over all ranks"):
        _, metrics = collector(rl, LongFlatEngine(), prompts=Refills()).collect([record(0), record(1)], 0)
    assert metrics["completion/len_mean"] == 1.5
    assert (metrics["completion/len_min"], metrics["completion/len_max"]) == (1.0, 2.0)
    assert metrics["reward/overlong_penalty_mean"] == 0.0
    assert metrics["reward/mean"] == 0.5  # the reward statistics already were over the trained rows


def test_reward_scorer_keeps_the_parts_of_its_loop_step():
    scorer = RewardScorer([])
    rollouts = CountingEngine().generate([record(0).to_prompt(make_char_tokenizer())], 2, None)
    total, metrics = scorer(rollouts)
    assert total.tolist() == [0.0, 0.0] and metrics == {}  # rewards: [] scores nothing


# -- docs/collect.md: a new metric over the collected batch is one entry in collect/shaping.py ----------------------
def distinct_completions(groups, batch, rl, max_new_tokens) -> dict[str, float]:
    """The share of groups whose completions are all different (a collapse detector)."""
    texts = [r.text for r in groups.rollouts]
    per_group = [texts[i:i + rl.group_size] for i in range(0, len(texts), rl.group_size)]
    return {"completion/distinct_group_frac": sum(len(set(g)) == len(g) for g in per_group) / len(per_group)}


def test_a_batch_metric_added_to_shaping_reaches_the_rollout_metrics(monkeypatch):
    monkeypatch.setattr(shaping, "BATCH_METRICS", [*shaping.BATCH_METRICS, distinct_completions])
    rl = GRPOConfig(batch_per_replica=4, group_size=GROUP, micro_batch_per_replica=4)
    _, metrics = collector(rl).collect([record(0), record(2)], loop_step=0)
    assert metrics["completion/distinct_group_frac"] == 1.0
    assert "completion/len_mean" in metrics  # the shipped metrics still run


def test_the_collect_package_imports_no_lightning():
    code = "import sys, lightning_grpo.collect; print(sorted(m for m in sys.modules if m.split('.')[0] == 'lightning'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
