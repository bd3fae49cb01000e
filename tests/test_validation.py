"""Validation during fit: greedy, through the module's engine, after the hand-off published the current policy."""

from __future__ import annotations

import csv
from dataclasses import replace

import pytest
from helpers import SMALL
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from lightning_grpo.collect.prompts import step_prompts
from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig
from lightning_grpo.data.prompts import PromptDataModule
from lightning_grpo.data.rewards import RewardSpec
from lightning_grpo.handoff import HandoffCallback
from lightning_grpo.handoff_events import CYCLE, ENGINE_SLEEP, TRAINER_ONLOAD
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.timing import is_timing
from lightning_grpo.validation import greedy_scores, pass_at_k, sampled_scores

PUBLISH, STEP = list(CYCLE[4:]), list(CYCLE[:4])  # wake weights, sync, offload, wake KV | generate, sleep, onload, train


def make_module() -> GRPOModule:
    seed_everything(0)
    return GRPOModule(policy=PolicyConfig(path="tiny:validation", tiny=SMALL),
                      rl=GRPOConfig(batch_per_replica=8, group_size=4), optim=OptimConfig(lr=1e-2),
                      rollout=RolloutConfig(max_new_tokens=3), rewards=[RewardSpec("arith")])


def fit(tmp_path, name: str, val_every: int | None) -> tuple[HandoffCallback, list[dict]]:
    """2 loop steps with host offload forced on (the trainer really leaves on CPU), validating every ``val_every``."""
    handoff = HandoffCallback(offload_backend="host")
    trainer = Trainer(max_steps=2, logger=CSVLogger(tmp_path, name=name), callbacks=[handoff], log_every_n_steps=1,
                      val_check_interval=val_every, limit_val_batches=None if val_every else 0,
                      num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(make_module(), datamodule=PromptDataModule("builtin:arith", val_size=8))
    with open(tmp_path / name / "version_0" / "metrics.csv", newline="") as f:
        return handoff, list(csv.DictReader(f))


@pytest.mark.slow
def test_validation_runs_after_publication_and_leaves_training_unchanged(tmp_path):
    handoff, rows = fit(tmp_path, "val", val_every=1)
    # each validation publishes the updated policy first; the next loop step then generates at once
    assert handoff.events == [ENGINE_SLEEP, *PUBLISH, *STEP, *PUBLISH, *STEP, *PUBLISH, ENGINE_SLEEP, TRAINER_ONLOAD]
    val = [r for r in rows if r["val/reward"]]
    assert [r["step"] for r in val] == ["1", "2"]  # x-axis: the loop step validated
    assert all(0 <= float(r["val/reward"]) <= 1 and float(r["val/len_mean"]) <= 3 for r in val)
    # the greedy draw runs on its own RNG stream: the training rollouts and updates are those of a run without it
    _, plain = fit(tmp_path, "plain", val_every=None)
    train = [{k: v for k, v in r.items() if not is_timing(k) and not k.startswith("val/")}
             for r in rows if r["reward/mean"]]
    assert train == [{k: v for k, v in r.items() if not is_timing(k)} for r in plain]


def test_validation_is_one_greedy_completion_per_prompt_from_the_engine():
    module = make_module()
    module.configure_model()
    module.engine = module.build_engine(will_sleep=False)
    module.collector = module.configure_collector()
    calls = []
    generate = module.engine.generate
    module.engine.generate = lambda prompts, g, sampling: calls.append((len(prompts), g, sampling)) or generate(
        prompts, g, sampling)
    records = PromptDataModule("builtin:arith", prompts_per_step=4, val_size=4).val_batches()[0]
    first, again = greedy_scores(module.collector, records, module.loop_step), greedy_scores(module.collector, records, module.loop_step)
    (n, group, sampling), _ = calls
    assert (n, group, sampling.temperature, sampling.max_new_tokens) == (4, 1, 0.0, 3)
    assert first == again  # greedy: the same completions every time
    assert set(first) == {"val/reward", "val/reward/arith", "val/reward/none_frac", "val/len_mean", "val/stop_frac"}


def test_validation_refuses_an_engine_left_asleep():
    """Generating while the hand-off has the engine asleep would sample from released memory: it raises."""
    module = make_module()
    module.configure_model()
    module.engine = module.build_engine(will_sleep=False)
    module.collector = module.configure_collector()
    module.engine.sleep(1)
    records = PromptDataModule("builtin:arith", prompts_per_step=4, val_size=4).val_batches()[0]
    with pytest.raises(RuntimeError, match="asleep"):
        greedy_scores(module.collector, records, module.loop_step)


# -- pass@k / mean@k: k sampled completions per held-out prompt (data.val_samples_per_prompt) --------------------
def test_pass_at_k_is_the_unbiased_estimator_of_chen_et_al():
    """Against the paper's numerically stable form, 1 - prod_{i=n-c+1}^{n} (1 - k/i), and hand values."""
    import math

    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert (pass_at_k(4, 0, 4), pass_at_k(4, 1, 4), pass_at_k(10, 3, 1)) == (0.0, 1.0, pytest.approx(0.3))
    for n, c, k in [(20, 3, 5), (200, 7, 10), (16, 15, 2), (30, 0, 30)]:
        stable = 1.0 if n - c < k else 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
        assert pass_at_k(n, c, k) == pytest.approx(stable, rel=1e-12, abs=1e-12)
    with pytest.raises(ValueError, match=r"pass_at_k\(n=3, c=1, k=4\)"):
        pass_at_k(3, 1, 4)


def test_sampled_scores_count_the_prompts_with_a_passing_draw():
    module = make_module()
    module.reward_specs = [RewardSpec("helpers:digit_share")]  # graded: an untrained policy passes 0.5 sometimes
    module.configure_model()
    module.engine = module.build_engine(will_sleep=False)
    module.collector = module.configure_collector()
    records = PromptDataModule("builtin:arith", prompts_per_step=4, val_size=6).val_batches()[0]
    prompts, _ = step_prompts(records, module.tokenizer, None, "error")
    k = 4
    got = sampled_scores(module.collector, prompts, k, 0.5, module.sampling())
    # the same draw by hand: training temperature, the validation seed
    draws = module.engine.generate(prompts, k, replace(module.sampling(), seed=0, logprobs=False))
    rewards = module.compute_rewards(draws)[0].view(len(prompts), k).tolist()
    assert got["val/pass@k"] == pytest.approx(sum(any(x >= 0.5 for x in row) for row in rewards) / len(prompts))
    assert got["val/pass@1"] == pytest.approx(sum(x >= 0.5 for row in rewards for x in row) / (k * len(prompts)))
    assert got["val/mean@k"] == pytest.approx(sum(map(sum, rewards)) / (k * len(prompts)))
    assert 0 < got["val/pass@1"] < got["val/pass@k"]  # an untrained policy at temperature 1: some draws pass


@pytest.mark.slow
def test_a_fit_logs_pass_at_k_and_mean_at_k_beside_the_greedy_reward(tmp_path):
    trainer = Trainer(max_steps=1, logger=CSVLogger(tmp_path, name="k"), log_every_n_steps=1, val_check_interval=1,
                      num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(make_module(), datamodule=PromptDataModule("builtin:arith", val_size=8, val_samples_per_prompt=3))
    with open(tmp_path / "k" / "version_0" / "metrics.csv", newline="") as f:
        val = [r for r in csv.DictReader(f) if r["val/reward"]]
    assert len(val) == 1 and all(val[0][m] != "" for m in ("val/pass@k", "val/pass@1", "val/mean@k"))
    assert 0 <= float(val[0]["val/pass@1"]) <= float(val[0]["val/pass@k"]) <= 1


def test_val_samples_per_prompt_must_be_a_count():
    with pytest.raises(ValueError, match=r"val_samples_per_prompt=-1"):
        PromptDataModule("builtin:arith", val_samples_per_prompt=-1)
