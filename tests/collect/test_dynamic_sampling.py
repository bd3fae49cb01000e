"""DAPO's dynamic sampling, overlong shaping and mask_truncated_completions on the tiny job (real engine, rewards,
update, checkpoints)."""

import pytest
import torch
from helpers import TINY_JOB, StepRecorder, char_codes, fit_tiny, global_determinism_restored
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_grpo.batch import pack_rollouts
from lightning_grpo.collect.groups import Groups
from lightning_grpo.collect.shaping import counted_only
from lightning_grpo.collect.staleness import stamps
from lightning_grpo.config import ConfigError, GRPOConfig, OptimConfig, RolloutConfig
from lightning_grpo.data.prompts import PromptDataModule
from lightning_grpo.data.rewards import RewardSpec, overlong_penalty
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.rollout.base import Prompt, Rollout
from lightning_grpo.timing import is_timing

pytestmark = [pytest.mark.integration, pytest.mark.heavy]  # a fit with a transformers policy: not the unit tier
# heavy: the shared 2-rank launch (tests/conftest.two_rank_cases); CI and `make test-integration` run it


def half_flat(rollouts):
    """Reward: char codes for prompts with an even id, a constant for odd ids (a zero-variance group)."""
    return [c if r.prompt.id % 2 == 0 else 0.5 for c, r in zip(char_codes(rollouts), rollouts)]


def rank0_short(rollouts):
    """half_flat, and flat on the refill lane positions q = -id - 1 with q % 4 in {0, 1}: on 2 ranks drawing 4 prompts
    a round, rank 0's share of every refill round (tests/dist_worker.py ``run_dynamic_fit``)."""
    def flat(i):
        return i % 2 == 1 or (i < 0 and (-i - 1) % 4 < 2)
    return [0.5 if flat(r.prompt.id) else c for c, r in zip(char_codes(rollouts), rollouts)]


def all_flat(rollouts):
    return [1.0] * len(rollouts)


class Recording(GRPOModule):
    """The tiny job that keeps every collected batch it trains on."""

    def update(self, batch):
        self.batches = [*getattr(self, "batches", []), batch]
        return super().update(batch)


def module(policy_dir, reward="test_dynamic_sampling:half_flat", **rl) -> Recording:
    return Recording(policy=PolicyConfig(path=str(policy_dir)), rl=GRPOConfig(**{**TINY_JOB["rl"], **rl}),
                     optim=OptimConfig(**TINY_JOB["optim"]), rollout=RolloutConfig(**TINY_JOB["rollout"]),
                     rewards=[RewardSpec(name=reward)], seed=0)


def test_half_flat_groups_are_refilled_to_full_batches_of_informative_groups(tiny_policy_dir, tmp_path):
    rec, m = StepRecorder(), module(tiny_policy_dir, dynamic_sampling=True)
    with global_determinism_restored():
        fit_tiny(m, tmp_path, loop_steps=2, callbacks=[rec])
    for batch in m.batches:
        assert len(batch) == 8 and bool(batch.completion_mask.any(-1).all())  # the config's size, every row trains
        grouped = batch.rewards.view(-1, 4)
        assert bool((grouped.amax(1) != grouped.amin(1)).all())  # every trained group has variance
        assert bool((batch.group_ids.view(-1, 4) % 2 == 0).all())  # the even (informative) ids only
    for row in rec.metrics:  # round 0: one of 2 groups flat; one refill round (2 prompts) brings the other
        assert (row["data/dynamic_groups_dropped"], row["data/dynamic_refill_rounds"]) == (2.0, 1.0)
        assert (row["data/dynamic_prompts_drawn"], row["data/dynamic_batch_short"], row["reward/frac_zero_std"]) == (2, 0, 0)
    refill_ids = [int(i) for b in m.batches for i in b.group_ids.unique() if i < 0]
    assert refill_ids == [-2, -4]  # the refill lane's ids: its own, never a loop step's


def test_resume_mid_run_draws_the_same_refills_and_equals_the_uninterrupted_run(tiny_policy_dir, tmp_path):
    with global_determinism_restored():
        whole, ckpt = StepRecorder(), ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}",
                                                      every_n_train_steps=2, save_top_k=-1)
        fit_tiny(module(tiny_policy_dir, dynamic_sampling=True), tmp_path / "a", loop_steps=3, callbacks=[whole, ckpt])
        saved = torch.load(tmp_path / "ckpt" / "step=1.ckpt", weights_only=True)
        assert saved["PromptDataModule"]["refill_rounds"] == 1  # the refill cursor travels with the data position
        resumed, m = StepRecorder(), module(tiny_policy_dir, dynamic_sampling=True)
        fit_tiny(m, tmp_path / "b", loop_steps=3, callbacks=[resumed], ckpt_path=tmp_path / "ckpt" / "step=1.ckpt")
    rows = [[{k: v for k, v in r.items() if not is_timing(k)} for r in run] for run in (whole.metrics[1:],
                                                                                            resumed.metrics)]
    assert rows[0] == rows[1] and resumed.prompt_ids == whole.prompt_ids[1:]
    assert [int(i) for b in m.batches for i in b.group_ids.unique() if i < 0] == [-4, -6]  # rounds 2 and 3


def test_a_save_inside_a_loop_step_records_the_refill_cursor_of_its_boundary():
    dm = PromptDataModule("builtin:arith", prompts_per_step=2, val_size=0)
    dm.mark_consumed(dm.records(0))
    dm.refill_records(), dm.refill_records()  # loop step 0 drew two refill rounds
    dm.mark_consumed(dm.records(1))
    first = dm.refill_records()  # inside loop step 1
    assert [r.id for r in first] == [-5, -6]
    assert dm.state_dict_at(1)["refill_rounds"] == 2 and dm.state_dict()["refill_rounds"] == 3
    again = PromptDataModule("builtin:arith", prompts_per_step=2, val_size=0)
    again.load_state_dict(dm.state_dict_at(1))  # resumed at loop step 1's boundary: its refill is drawn again
    assert [(r.id, r.text) for r in again.refill_records()] == [(r.id, r.text) for r in first]


def test_cannot_fill_warns_with_the_counts_trains_on_what_there_is_and_ends(tiny_policy_dir, tmp_path):
    rec, m = StepRecorder(), module(tiny_policy_dir, reward="test_dynamic_sampling:all_flat", dynamic_sampling=True,
                                    max_refill_rounds=2)
    with pytest.warns(UserWarning, match=r"2 informative group\(s\) short over all ranks after 2 refill round\(s\) "
                                         r"\(rl.max_refill_rounds=2; this rank found 0 of 2\)"):
        fit_tiny(m, tmp_path, loop_steps=2, callbacks=[rec])
    assert [len(b) for b in m.batches] == [8, 8]  # the config's size: padded with the first flat groups
    assert all(not bool(b.completion_mask.any()) for b in m.batches)  # nothing counts: no divisor, no gradient
    assert [r["data/dynamic_batch_short"] for r in rec.metrics] == [2.0, 2.0]
    assert [r["data/dynamic_prompts_drawn"] for r in rec.metrics] == [4.0, 4.0]
    assert [r["grpo/tokens"] for r in rec.metrics] == [0.0, 0.0]


def test_overlong_penalty_follows_dapo_eq_13():
    # max_new_tokens 20, buffer 5: free up to 15 tokens, then (15 - L) / 5 * 0.5 down to -0.5 at 20
    lengths = torch.tensor([3, 15, 16, 18, 20, 22])
    expected = [0.0, 0.0, -0.1, -0.3, -0.5, -0.5]
    assert overlong_penalty(lengths, 20, 5, 0.5).tolist() == pytest.approx(expected, abs=1e-7)
    assert overlong_penalty(lengths, 20, 0).tolist() == [0.0] * 6


def test_overlong_penalty_shapes_the_rewards_and_is_logged(tiny_policy_dir, tmp_path):
    rec, m = StepRecorder(), module(tiny_policy_dir, reward="test_dynamic_sampling:all_flat", overlong_buffer=2,
                                    overlong_penalty=0.5)
    fit_tiny(m, tmp_path, loop_steps=1, callbacks=[rec])
    (batch,) = m.batches
    lengths = batch.completion_mask.sum(-1)  # nothing masked here: the completion lengths
    assert batch.rewards.tolist() == pytest.approx((1.0 - (lengths - 2).clamp(min=0) / 2 * 0.5).tolist())
    assert rec.metrics[0]["reward/overlong_penalty_mean"] == pytest.approx(float(batch.rewards.mean()) - 1.0)


def test_mask_truncated_completions_masks_exactly_the_length_finished_rows():
    prompt = Prompt(0, [5, 6], "p")
    finish = ["stop", "length", "length", "stop"]
    rollouts = [Rollout(prompt, [7, 8, 9][: 1 + i % 3], "", f) for i, f in enumerate(finish)]
    batch = pack_rollouts(rollouts, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.zeros(4), pad_id=0)
    live = torch.ones(4, dtype=torch.bool)
    groups = Groups(rollouts, torch.zeros(4), live, live, stamps(4, 0))
    masked = counted_only(batch, groups, mask_truncated=True)
    assert masked.completion_mask.any(-1).tolist() == [True, False, False, True]
    assert torch.equal(masked.completion_mask[[0, 3]], batch.completion_mask[[0, 3]])
    assert torch.equal(masked.advantages, batch.advantages)  # their rewards still counted in the group
    assert counted_only(batch, groups, mask_truncated=False) is batch


def test_mask_truncated_completions_in_a_run_logs_what_it_masked(tiny_policy_dir, tmp_path):
    rec, m = StepRecorder(), module(tiny_policy_dir, mask_truncated_completions=True)
    fit_tiny(m, tmp_path, loop_steps=1, callbacks=[rec])
    (batch,) = m.batches
    masked = int((~batch.completion_mask.any(-1)).sum())
    assert rec.metrics[0]["completion/truncated_masked"] == masked
    assert rec.metrics[0]["grpo/tokens"] == int(batch.completion_mask.sum())


@pytest.mark.parametrize(("rl", "knob"), [
    ({"max_refill_rounds": -1}, "max_refill_rounds=-1"),
    ({"dynamic_sampling": "yes"}, "dynamic_sampling='yes'"),
    ({"overlong_buffer": -2}, "overlong_buffer=-2"),
    ({"overlong_penalty": float("nan")}, "overlong_penalty=nan"),
    ({"mask_truncated_completions": 1}, "mask_truncated_completions=1"),
])
def test_config_refusals_name_the_knob(rl, knob):
    with pytest.raises(ConfigError, match=knob):
        GRPOConfig(**rl)


def test_an_overlong_buffer_as_long_as_the_completion_is_refused(tiny_policy_dir):
    with pytest.raises(ConfigError, match=r"overlong_buffer=4: must be below rollout.max_new_tokens=4"):
        module(tiny_policy_dir, overlong_buffer=4)
    assert module(tiny_policy_dir, overlong_buffer=3).rl.overlong_buffer == 3


def test_two_ranks_agree_on_refill_rounds_and_one_short_rank_does_not_hang(two_rank_cases):
    """tests/dist_worker.py ``run_dynamic_fit``: rank 0 can never fill (its refills are flat), rank 1 fills after one
    round; both draw the agreed 3 rounds, rank 1 generating nothing, and the step ends on both."""
    r0, r1 = (two_rank_cases("ddp-dynamic-fit", r) for r in (0, 1))
    for r in (r0, r1):  # one figure per metric for the job, the same on both ranks
        assert r["metrics"]["data/dynamic_refill_rounds"] == 3.0 and r["metrics"]["data/dynamic_batch_short"] == 1.0
    same = [k for k in r0["metrics"] if not is_timing(k)]
    assert [r0["metrics"][k] for k in same] == [r1["metrics"][k] for k in same]
    assert all(r1["trained_rows"]) and set(r1["group_ids"]) == {2, -4}  # rank 1: its even group and refill -4
    assert sum(r0["trained_rows"]) == 2 and 0 in r0["group_ids"]  # rank 0: its one informative group, the rest padding
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])  # one model
