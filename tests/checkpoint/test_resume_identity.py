"""A resume under another config: seed/model/dtype refused, optimizer hyper-parameters applied with a warning."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import fit_tiny, tiny_grpo_module

from lightning_grpo.checkpoint.identity import IDENTITY_KEY, ResumeMismatchError, optim_changes


@pytest.fixture(scope="module")
def one_step(tiny_policy_dir, tmp_path_factory):
    """A checkpoint after loop step 1 of TINY_JOB, and the LR an uninterrupted 2-step run ends with."""
    root = tmp_path_factory.mktemp("identity")
    trainer = fit_tiny(tiny_grpo_module(tiny_policy_dir), root, loop_steps=1)
    ckpt = root / "step1.ckpt"
    trainer.save_checkpoint(ckpt)
    whole = fit_tiny(tiny_grpo_module(tiny_policy_dir), root, loop_steps=2)
    return ckpt, whole.optimizers[0].param_groups[0]["lr"]


@pytest.mark.slow
def test_a_changed_learning_rate_is_applied_with_a_warning_naming_old_and_new(one_step, tiny_policy_dir, tmp_path):
    ckpt, lr_uninterrupted = one_step
    module = tiny_grpo_module(tiny_policy_dir)
    module.optim_cfg = replace(module.optim_cfg, lr=2e-3, weight_decay=0.1)
    with pytest.warns(UserWarning, match=r"optim.lr 0.001 -> 0.002; optim.weight_decay 0.0 -> 0.1; applied") as w:
        trainer = fit_tiny(module, tmp_path, loop_steps=2, ckpt_path=str(ckpt))
    group = trainer.optimizers[0].param_groups[0]
    assert group["lr"] == pytest.approx(2 * lr_uninterrupted, rel=1e-12)  # the schedule's position, the new base
    assert group["weight_decay"] == 0.1
    said = [str(x.message) for x in w if "applied" in str(x.message)]
    assert len(said) == 1 and f"learning rate is now {group['lr']:.4g}" in said[0]
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr() == [group["lr"]]


@pytest.mark.slow
@pytest.mark.parametrize("change", ["seed", "dtype"])
def test_a_resume_that_changes_seed_or_dtype_is_refused(change, one_step, tiny_policy_dir, tmp_path):
    ckpt, _ = one_step
    module = tiny_grpo_module(tiny_policy_dir, seed=1 if change == "seed" else 0)
    if change == "dtype":
        module.policy_cfg = replace(module.policy_cfg, dtype="bfloat16")
    said = "seed: 0 in the checkpoint, 1 now" if change == "seed" else "policy.dtype: 'float32' in the checkpoint"
    with pytest.raises(ResumeMismatchError, match=said):
        fit_tiny(module, tmp_path, loop_steps=2, ckpt_path=str(ckpt))


def test_a_checkpoint_without_an_identity_is_not_compared():
    now = {"seed": 0, "model": "qwen2, 10 parameters", "policy.dtype": "float32", "optim": {"lr": 1.0}}
    assert optim_changes(None, now) == {} and IDENTITY_KEY == "grpo_run"
    with pytest.raises(ResumeMismatchError, match=r"model: 'llama, 12 parameters' in the checkpoint, 'qwen2, 10"):
        optim_changes({**now, "model": "llama, 12 parameters"}, now)


def test_a_new_base_lr_lands_at_the_schedules_position_and_in_its_own_state():
    """checkpoint/identity.set_base_lr under transformers' cosine-with-warmup (a LambdaLR): the LR at the current
    position from the new base, get_last_lr() agrees, and the schedule continues from there."""
    from transformers import get_cosine_schedule_with_warmup

    from lightning_grpo.checkpoint.identity import set_base_lr

    def stepped(lr: float):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)
        sched = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=3, num_training_steps=10)
        for _ in range(5):
            optimizer.step()
            sched.step()
        return optimizer, sched

    optimizer, sched = stepped(1e-3)
    twin, twin_sched = stepped(2e-3)
    set_base_lr(2e-3, optimizer, [sched])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(twin.param_groups[0]["lr"], rel=1e-12)
    assert sched.get_last_lr() == [optimizer.param_groups[0]["lr"]]
    optimizer.step()
    sched.step()
    twin.step()
    twin_sched.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(twin.param_groups[0]["lr"], rel=1e-12)
