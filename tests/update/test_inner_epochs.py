"""rl.mu_iterations: inner epochs over one collected batch against the one frozen pi_old of the rollout policy."""

# A test marked slow here has its toy-model twin of the same name in tests/update/test_ahead_unit.py
# (the unit tier); the runs here, through a GRPOModule on the tiny Qwen2 policy, are the slow tier's.

from types import SimpleNamespace

import pytest
import torch
from helpers import StepRecorder, clone, fit_tiny, global_determinism_restored, synthetic_batch, tiny_grpo_module
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_grpo.config import GRPOConfig
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.timing import is_timing

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier

LENS = [3, 9, 1, 6, 12, 2, 5, 8, 4, 10, 7, 11, 6, 2, 9, 3]


def make(policy_dir, mu=2, mini=8, lr=3e-2, **rl):
    cfg = GRPOConfig(batch_per_replica=16, group_size=2, mini_batch_per_replica=mini, mu_iterations=mu, **rl)
    module = GRPOModule(policy=PolicyConfig(path=str(policy_dir)), rl=cfg, seed=3)
    module.configure_model()
    module.updater.attach(torch.optim.AdamW(module.policy.parameters(), lr=lr))
    return module


def record_pi_old(module) -> list[tuple[int, tuple, torch.Tensor | None]]:
    """(epoch, sample ids, pi_old handed to the objective) of every training chunk."""
    seen, real = [], module.updater.loop.forward_chunk

    def forward(chunk, old):
        seen.append((module.updater.loop.progress.epoch, tuple(chunk.sample_ids.tolist()), old))
        return real(chunk, old)

    module.updater.loop.forward_chunk = forward
    return seen


@pytest.mark.slow
def test_every_epoch_scores_against_the_rollout_policy_and_the_clip_binds_more_in_epoch_2(tiny_policy_dir):
    module = make(tiny_policy_dir)  # n_mini = 2, mu = 2: 4 optimizer steps
    rollout_policy = clone(module.policy)
    seen = record_pi_old(module)
    batch = synthetic_batch(LENS, seed=11)
    result = module.updater.update(batch)
    assert len(result.steps) == 4 and module.updater.loop.progress.optimizer_steps == 4 and module.updater.loop.progress.epoch == 1
    assert [e for e, _, _ in seen] == [0, 0, 1, 1]
    assert all(old is not None for _, _, old in seen)  # mini-batch 0 is recorded too: epoch 2 trains it again
    by_chunk = {}
    for _, ids, old in seen:
        by_chunk.setdefault(ids, []).append(old)
    for ids, (first, second) in by_chunk.items():
        assert second is first  # the same record: pi_old is computed once per collected batch, never per epoch
        rows = torch.tensor(ids)  # sample ids are row numbers in synthetic_batch
        with torch.no_grad():
            expected = module.scorer.logprobs(rollout_policy.eval(), batch.select(rows))
        assert torch.allclose(first, expected, atol=1e-5)  # ... and it is the rollout policy's

    # Recomputing pi_old at the start of epoch 2 would score against the moved policy: these tests would catch it.
    now = module.updater.ahead.compute(batch, module.updater.last_plan, module.updater.needs)
    moved = max(float((a - b).abs().max()) for a, (_, _, b) in zip(now, seen))
    assert moved > 1e-3

    module.report(result, {})
    m = module.last_metrics
    assert m["grpo/epoch2/clip_frac"] > m["grpo/epoch1/clip_frac"]
    assert m["grpo/epoch2/kl_old"] > m["grpo/epoch1/kl_old"] > 0
    assert m["grpo/optimizer_steps"] == 4


@pytest.mark.slow
def test_recomputing_pi_old_per_epoch_collapses_the_clip(tiny_policy_dir):
    """The failure the test above guards: pi_old recomputed at each epoch start clips less in epoch 2."""
    frozen, one = make(tiny_policy_dir), make(tiny_policy_dir, mu=1)
    batch = synthetic_batch(LENS, seed=11)
    frozen.report(frozen.updater.update(batch), {})
    # epoch by epoch, each a collected batch of its own: pi_old is taken afresh from the moved policy
    one.updater.update(batch)
    second = one.updater.update(batch)
    one.report(second, {})
    assert one.last_metrics["grpo/clip_frac"] < frozen.last_metrics["grpo/epoch2/clip_frac"]


@pytest.mark.slow
def test_ahead_pass_records_mini_batch_0_at_mu_2_even_after_the_probe(tiny_policy_dir):
    module = make(tiny_policy_dir, mini=4)
    module.updater.update(synthetic_batch(LENS, seed=1))
    assert module.updater.ahead.probe_passed and not module.updater.ahead.skips_first_mini(module.updater.needs, 2)
    assert module.updater.ahead.skips_first_mini(module.updater.needs, 1)  # a single epoch may skip it
    again = synthetic_batch(LENS, seed=2)
    pi_old = module.updater.ahead.compute(again, module.updater.plan(again)[0], module.updater.needs)
    assert len(pi_old) == 2 * 4 and all(old is not None for old in pi_old)


@pytest.mark.slow
def test_later_epochs_reshuffle_the_mini_batch_order_deterministically(tiny_policy_dir):
    module = make(tiny_policy_dir, mu=3, mini=2)  # n_mini = 8
    batch = synthetic_batch(LENS)
    plan, _ = module.updater.plan(batch)
    assert plan.order[0] == tuple(range(8)) and len(plan.order) == 3
    assert all(sorted(o) == list(range(8)) for o in plan.order) and plan.order[1] != plan.order[0]
    assert module.updater.plan(batch)[0].order == plan.order  # the same seed and loop step: the same order
    module.updater.loop.progress.loop_step += 1
    assert module.updater.plan(batch)[0].order != plan.order  # a new one every loop step


@pytest.mark.slow
def test_mu_with_a_token_budget_walks_the_same_chunks_each_epoch(tiny_policy_dir):
    module = make(tiny_policy_dir, max_tokens_per_micro=40)
    seen = record_pi_old(module)
    module.updater.update(synthetic_batch(LENS, seed=4))
    epochs = [sorted(ids for e, ids, _ in seen if e == k) for k in (0, 1)]
    assert epochs[0] == epochs[1] and len(epochs[0]) > 2


# -- under a Trainer: counters, max_steps, LR horizon, checkpoints, resume -----------------------------------------
MU_JOB = {"mu_iterations": 2, "max_tokens_per_micro": 24}


def mu_module(policy_dir):
    module = tiny_grpo_module(policy_dir)
    for k, v in MU_JOB.items():
        setattr(module.rl, k, v)
    module.rl.validate()
    return module


@pytest.fixture(scope="module")
def mu_run(tiny_policy_dir, tmp_path_factory):
    """The tiny job (n_mini = 2) at mu = 2 for 3 loop steps, a plain ModelCheckpoint after every loop step."""
    with global_determinism_restored():
        rec, root = StepRecorder(), tmp_path_factory.mktemp("mu")
        ckpt = ModelCheckpoint(dirpath=root / "ckpt", filename="{step}", every_n_train_steps=4, save_top_k=-1)
        module = mu_module(tiny_policy_dir)
        trainer = fit_tiny(module, root, loop_steps=3, callbacks=[rec, ckpt])
    return SimpleNamespace(trainer=trainer, module=module, rows=rec.metrics, ckpt=root / "ckpt",
                           params={k: v.clone() for k, v in module.policy.state_dict().items()})


def test_counters_max_steps_and_lr_horizon_follow_mu(mu_run):
    trainer, module = mu_run.trainer, mu_run.module
    assert module.rl.steps_per_loop_step == 4
    assert trainer.global_step == 12 and module.loop_step == 3  # max_steps = 3 loop steps x 2 epochs x n_mini 2
    assert module.schedule_horizon == 12  # the cosine spans the run's optimizer steps, not its loop steps
    assert module.lr_schedulers().last_epoch == 12
    assert [r["global_step"] for r in mu_run.rows] == [4.0, 8.0, 12.0]
    assert all(r["grpo/optimizer_steps"] == 4.0 and "grpo/epoch2/clip_frac" in r for r in mu_run.rows)
    assert sorted(p.name for p in mu_run.ckpt.iterdir()) == ["step=1.ckpt", "step=2.ckpt", "step=3.ckpt"]


def test_resume_at_mu_2_equals_the_uninterrupted_run(mu_run, tiny_policy_dir, tmp_path):
    with global_determinism_restored():
        resumed, module = StepRecorder(), mu_module(tiny_policy_dir)
        fit_tiny(module, tmp_path, loop_steps=3, callbacks=[resumed], ckpt_path=mu_run.ckpt / "step=1.ckpt")
    strip = [{k: v for k, v in r.items() if not is_timing(k)} for r in resumed.metrics]
    assert strip == [{k: v for k, v in r.items() if not is_timing(k)} for r in mu_run.rows[1:]]
    final = module.policy.state_dict()
    assert all(torch.equal(final[k], v) for k, v in mu_run.params.items())
