"""Determinism mode: the cuBLAS launch-env decision, the switches it sets, and seeded runs that repeat exactly."""

import numpy as np
import pytest
import torch
from helpers import StepRecorder, fit_tiny, global_determinism_restored, tiny_grpo_module

from lightning_grpo.data.prompts import PromptDataModule
from lightning_grpo.determinism import (
    CUBLAS_ENV,
    SEED_ENV,
    CudaState,
    DeterminismError,
    RunSeed,
    cublas_problem,
    enable_determinism,
    run_seed,
)
from lightning_grpo.timing import is_timing

CPU = CudaState(available=False, initialized=False)
CUDA_IDLE = CudaState(available=True, initialized=False)
CUDA_UP = CudaState(available=True, initialized=True)


@pytest.fixture(autouse=True)
def _restore_switches():
    with global_determinism_restored():
        yield


# -- the decision ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cuda", [CPU, CUDA_IDLE, CUDA_UP])
@pytest.mark.parametrize("value", [":4096:8", ":16:8"])
def test_a_valid_launch_value_always_passes(cuda, value):
    assert cublas_problem(cuda, {CUBLAS_ENV: value}) is None


def test_cpu_only_needs_nothing():
    assert cublas_problem(CPU, {}) is None


def test_cuda_initialized_without_the_variable_refuses_and_says_export_before_launch():
    problem = cublas_problem(CUDA_UP, {})
    assert "is unset" in problem and "already initialized" in problem
    assert f"export {CUBLAS_ENV}=:4096:8" in problem and "before launching" in problem


def test_cuda_not_yet_initialized_also_refuses_rather_than_setting_it_late():
    problem = cublas_problem(CUDA_IDLE, {})
    assert "engine workers" in problem and f"export {CUBLAS_ENV}" in problem


def test_a_value_cublas_ignores_is_refused():
    assert "':0:0', which cuBLAS does not treat as deterministic" in cublas_problem(CUDA_UP, {CUBLAS_ENV: ":0:0"})


def test_enable_raises_before_touching_any_switch():
    torch.use_deterministic_algorithms(False)
    with pytest.raises(DeterminismError, match="export CUBLAS_WORKSPACE_CONFIG"):
        enable_determinism(0, cuda=CUDA_UP, env={})
    assert not torch.are_deterministic_algorithms_enabled()


def test_enable_sets_the_switches_and_seeds():
    enable_determinism(123, cuda=CPU, env={})
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.mem_efficient_sdp_enabled()
    first = (torch.rand(3), np.random.rand(3))
    enable_determinism(123, cuda=CPU, env={})
    assert torch.equal(first[0], torch.rand(3)) and np.array_equal(first[1], np.random.rand(3))


# -- seeded runs -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tiny_policy_dir, tmp_path_factory):
    """Three fresh 2-loop-step runs in determinism mode: seed 0, seed 0 again, seed 1."""
    out = {}
    for name, seed in (("a", 0), ("b", 0), ("other", 1)):
        with global_determinism_restored():
            module, rec = tiny_grpo_module(tiny_policy_dir, seed=seed), StepRecorder()
            fit_tiny(module, tmp_path_factory.mktemp(name), loop_steps=2, callbacks=[rec])
        out[name] = (rec, {k: v.detach().clone() for k, v in module.policy.state_dict().items()})
    return out


@pytest.mark.heavy  # three fits (make test keeps tests/test_golden_metrics.py): CI and `make test-integration`
def test_same_seed_gives_identical_metrics_parameters_and_prompt_ids(runs):
    (rec_a, params_a), (rec_b, params_b) = runs["a"], runs["b"]
    assert len(rec_a.metrics) == 2
    for ma, mb in zip(rec_a.metrics, rec_b.metrics):
        assert {k: v for k, v in ma.items() if not is_timing(k)} == {k: v for k, v in mb.items() if not is_timing(k)}
    assert rec_a.metrics[-1]["grpo/grad_norm"] > 0  # the runs did learn something (not a vacuous equality)
    assert all(torch.equal(params_a[k], params_b[k]) for k in params_a)
    assert rec_a.prompt_ids == rec_b.prompt_ids == [[0, 1], [2, 3]]


def test_another_seed_differs(runs):
    (rec_a, params_a), (rec_o, params_o) = runs["a"], runs["other"]
    assert rec_a.prompt_ids == rec_o.prompt_ids  # the prompt stream is the data's, not the sampling seed's
    assert [m["reward/mean"] for m in rec_a.metrics] != [m["reward/mean"] for m in rec_o.metrics] or \
        [m["grpo/loss"] for m in rec_a.metrics] != [m["grpo/loss"] for m in rec_o.metrics]
    assert any(not torch.equal(params_a[k], params_o[k]) for k in params_a)


# -- prompt ids ----------------------------------------------------------------------------------------------------
def _ids(dm: PromptDataModule, steps: range) -> list[list[int]]:
    return [[r.id for r in dm.records(s)] for s in steps]


def test_prompt_ids_repeat_partition_and_stay_unique_across_ranks_and_resume():
    def rank(r: int, world: int = 2) -> PromptDataModule:
        dm = PromptDataModule("builtin:arith", prompts_per_step=4, val_size=0)
        dm.rank, dm.world_size = r, world
        return dm

    uninterrupted = [_ids(rank(r), range(6)) for r in (0, 1)]
    assert uninterrupted == [_ids(rank(r), range(6)) for r in (0, 1)]  # a second run: same ids, same partition
    assert [a + b for a, b in zip(*uninterrupted)] == _ids(rank(0, world=1), range(6))  # ranks tile the stream
    resumed = []
    for r in (0, 1):  # each rank stops after 3 steps and resumes from its state_dict
        first = rank(r)
        for step in range(3):
            first.mark_consumed(first.records(step))
        again = rank(r)
        again.load_state_dict(first.state_dict())
        resumed.append(_ids(first, range(3)) + _ids(again, range(again.position, 6)))
    assert resumed == uninterrupted
    every = [i for per_rank in resumed for step in per_rank for i in step]
    assert len(every) == len(set(every)) == 24  # unique across ranks and across the resume


# -- the run's seed: one source of truth -------------------------------------------------------------------------
def test_run_seed_is_model_seed_else_seed_everything_else_zero(caplog):
    assert run_seed(None, env={}) == RunSeed(0, "default")
    assert run_seed(None, env={SEED_ENV: "7"}) == RunSeed(7, "seed_everything")
    with caplog.at_level("INFO"):
        assert run_seed(3, env={SEED_ENV: "7"}) == RunSeed(3, "model.seed")
    assert "model.seed=3 overrides seed_everything=7" in caplog.text
    assert run_seed(3, env={}) == RunSeed(3, "model.seed")


def test_the_module_takes_the_seed_lightning_applied(tiny_policy_dir, monkeypatch):
    from lightning.pytorch import seed_everything

    seed_everything(11)
    assert tiny_grpo_module(tiny_policy_dir, seed=None).seed == 11
    assert tiny_grpo_module(tiny_policy_dir, seed=4).seed == 4
