"""OPD, DPO and GRPO's loss family and rollout corrections on 2 CPU gloo ranks (DDP) equal one rank on the same
batch, to 1e-12 in float64.

The same harness as test_distributed.py: two ``dist_worker.py`` processes started the way torchrun
starts them, each a real ``Trainer.fit`` of one step on its share of a fixed batch whose long sequences
sit on rank 0 (so a per-rank divisor would be wrong), stepped with plain SGD (update = lr x gradient).
"""

from __future__ import annotations

import dist_worker as W
import pytest
import torch
from helpers import max_rel_delta, params_of

pytestmark = [pytest.mark.integration, pytest.mark.heavy]  # a fit with a transformers policy: not the unit tier
# heavy: the shared 2-rank launch (tests/conftest.two_rank_cases); CI and `make test-integration` run it

TOL = 1e-12  # float64 (tests/dist_worker.objective_module): measured <= 2e-15 over every case
CASES = ["opd-full-m1", "opd-full-m4", "opd-sampled-m4", "opd-full-rewards-m2", "dpo-m1", "dpo-m4",
         *(f"grpo-{name}-m{n}" for name in W.FAMILY for n in (1, 2))]


@pytest.fixture(scope="module")
def two_ranks(two_rank_cases):
    """Every case of CASES run on 2 gloo ranks once (tests/conftest.py's one launch); ``load(case, rank)``."""
    return two_rank_cases


def one_rank(policy_dir, teacher_dir, case: str):
    """(params before, after) of the same step in one process."""
    module = W.objective_module(case, str(policy_dir), str(teacher_dir))
    module.configure_model()
    before = params_of(module.policy)
    module.updater.attach(torch.optim.SGD(module.policy.parameters(), lr=W.objective_lr(case)))
    if case.startswith("dpo"):
        module.update(module.encode(W.dpo_pairs()))  # DPO: the reference pass, then the updater
    elif case.startswith("grpo"):  # n_mini=2: 2-rank mini-batch m holds rows 2m, 2m+1 of each rank's half
        module.updater.update(W.objective_batch(case, module).select(torch.tensor([0, 1, 4, 5, 2, 3, 6, 7])))
    else:
        module.updater.update(W.objective_batch(case, module))
    return before, params_of(module.policy)


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one_rank(two_ranks, tiny_policy_dir, tiny_teacher_dir, case):
    before, ref = one_rank(tiny_policy_dir, tiny_teacher_dir, case)
    r0, r1 = two_ranks(case, 0), two_ranks(case, 1)
    assert max(float((ref[k] - before[k]).abs().max()) for k in ref) > 0.01  # a real step, far above rounding
    assert max_rel_delta(before, ref, r0["params"]) <= TOL
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in ref)  # the ranks hold one model


def test_metrics_combine_to_the_whole_batch(two_ranks):
    opd = two_ranks("opd-full-m4")["metrics"]
    assert opd["grpo/tokens"] == sum(W.LENGTHS) and opd["grpo/n"] == len(W.LENGTHS)
    assert opd["grpo/loss"] == pytest.approx(opd["opd/kl"], rel=1e-5)  # beta_opd = 1: the loss is the token-mean KL
    tis = two_ranks("grpo-tis-m2")["metrics"]
    assert tis["correction/tokens"] == sum(W.LENGTHS) and 0 < tis["correction/outside_frac"] < 1
    assert 0 < tis["correction/ess"] <= 1
    entropy = two_ranks("grpo-entropy-m2")["metrics"]
    assert entropy["grpo/entropy"] > 0 and entropy["grpo/tokens"] == sum(W.LENGTHS)
    holes = two_ranks("grpo-holes-m2")["metrics"]  # tool tokens are in no divisor: 4 rows lose 4 tokens each
    assert holes["grpo/tokens"] == sum(W.LENGTHS) - 4 * 4 == holes["correction/tokens"]
    dpo = two_ranks("dpo-m4")["metrics"]
    assert dpo["dpo/pairs"] == len(W.LENGTHS) and dpo["dpo/optimizer_steps"] == 1.0
