"""Replay engine and packing: recorded rollouts become an exact collected batch."""

import json

import pytest
import torch

from lightning_grpo.batch import pack_rollouts
from lightning_grpo.rollout.base import Prompt, SamplingConfig
from lightning_grpo.rollout.replay import ReplayEngine
from lightning_grpo.update.plan import BatchSizeError, ChunkPlan

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier


def write(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def recorded(n_groups=2, group=2):
    return [{"prompt_id": g, "prompt_ids": [1, 10 + g], "completion_ids": [20 + j] * (j + 1) + [2],
             "reward": float(j), "logprobs": [-0.5] * (j + 2)} for g in range(n_groups) for j in range(group)]


def test_replay_serves_groups_in_order_and_wraps(tmp_path):
    engine = ReplayEngine(write(tmp_path / "r.jsonl", recorded()), eos_token_id=2)
    out = engine.generate([Prompt(id=i, token_ids=[]) for i in range(3)], 2, SamplingConfig())
    assert [r.prompt.token_ids for r in out] == [[1, 10], [1, 10], [1, 11], [1, 11], [1, 10], [1, 10]]
    assert [r.reward for r in out[:2]] == [0.0, 1.0] and out[0].finish_reason == "stop"
    assert [r.prompt.id for r in out] == [0, 0, 1, 1, 2, 2]


def test_pack_aligns_masks_and_logprobs(tmp_path):
    engine = ReplayEngine(write(tmp_path / "r.jsonl", recorded()), eos_token_id=2)
    out = engine.generate([Prompt(id=0, token_ids=[])], 2, SamplingConfig())
    batch = pack_rollouts(out, torch.tensor([1.0, -1.0]), torch.tensor([0.0, 1.0]), pad_id=0)
    assert batch.input_ids.tolist() == [[1, 10, 20, 2, 0], [1, 10, 21, 21, 2]]
    assert batch.completion_mask.tolist() == [[False, False, True, True, False], [False, False, True, True, True]]
    assert batch.attention_mask.sum(-1).tolist() == [4, 5]
    assert batch.rollout_logprobs[0].tolist() == [0, 0, -0.5, -0.5, 0]
    assert batch.sample_ids.tolist() == [0, 1]
    with pytest.raises(ValueError, match="rollout 1 .* 5 tokens, over the model context of 4"):
        pack_rollouts(out, torch.zeros(2), torch.zeros(2), pad_id=0, max_len=4)


@pytest.mark.parametrize(
    "records,match",
    [([{"prompt_id": 0, "prompt_ids": [1]}], r"r.jsonl:1: replay record lacks \['completion_ids', 'reward'\]"),
     ([], "no replay records"),
     ([{"prompt_id": 0, "prompt_ids": [1], "completion_ids": [3, 4], "reward": 1, "logprobs": [0.0]}],
      "1 logprobs for 2 completion tokens")],
)
def test_bad_replay_files_are_refused_with_the_line(tmp_path, records, match):
    with pytest.raises(ValueError, match=match):
        ReplayEngine(write(tmp_path / "r.jsonl", records))


def test_short_group_is_refused(tmp_path):
    engine = ReplayEngine(write(tmp_path / "r.jsonl", recorded(group=2)))
    with pytest.raises(ValueError, match="has 2 completions, rl.group_size=4"):
        engine.generate([Prompt(id=0, token_ids=[])], 4, SamplingConfig())


def test_chunk_plan_rows_and_size_errors():
    plan = ChunkPlan.fixed(8, 2, 2)
    assert plan.rows == (((0, 1), (2, 3)), ((4, 5), (6, 7)))
    assert list(plan.walk()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(BatchSizeError, match="has 6 trajectories on this rank but the config expects 8"):
        ChunkPlan.fixed(6, 2, 2, expected_rows=8)
    with pytest.raises(BatchSizeError, match="does not split into n_mini=2 x n_micro=2"):
        ChunkPlan.fixed(6, 2, 2)
