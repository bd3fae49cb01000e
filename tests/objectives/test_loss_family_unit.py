"""Every allowed combination of the loss family (rl.loss_type x rl.ratio_level x rl.loss) through a real Updater on
the toy float64 model: chunked (fixed and token-budgeted) equals unchunked to 1e-12 over two inner epochs whose
second clips, and one chunk is bit-identical to the whole-batch objective call.

Was tests/update/test_loss_family.py on the tiny Qwen2 policy (there: 5e-8, since Qwen2's RMSNorm and softmax round the
backward to float32 even in a float64 model); on the toy model only the summation order differs, so a wrong divisor
cannot hide under the tolerance. Those transformers runs now run in the slow tier.
"""

from __future__ import annotations

import pytest
import torch
from helpers import max_rel_delta, params_of, synthetic_batch
from toy import UNEQUAL, make_toy, score

from lightning_grpo.config import LOSS_TYPES
from lightning_grpo.metrics import roll_up
from lightning_grpo.objectives.grpo import GRPOObjective
from lightning_grpo.update import Needs, Split

COMBOS = [(t, r, f) for t in LOSS_TYPES for r in ("token", "sequence") for f in ("ppo_clip", "cispo")
          if not (f == "cispo" and r == "sequence")]  # the one refused combination (tests/update/test_loss_family.py)
CHUNKINGS = (("whole", {}), ("fixed", {"n_micro": 4}), ("budget", {"max_tokens_per_micro": 40}))


@pytest.mark.parametrize("loss_type,ratio_level,loss", COMBOS)
def test_chunked_update_equals_unchunked_in_float64(loss_type, ratio_level, loss):
    """Two inner epochs against a frozen pi_old: the second sees ratios off 1 and clips; both chunkings equal one."""
    batch = synthetic_batch(UNEQUAL, seed=1)
    obj = GRPOObjective(0.01, 0.01, loss_type=loss_type, ratio_level=ratio_level, loss=loss, max_completion_length=20)
    toys = {name: make_toy(Split(rows=8, mu_iterations=2, **kw), Needs(pi_old=True), lr=1.0, objective=obj)
            for name, kw in CHUNKINGS}
    before = params_of(toys["whole"].model)
    results = {name: toy.updater.update(batch) for name, toy in toys.items()}
    assert toys["fixed"].updater.last_plan.real_chunks == 4 and toys["budget"].updater.last_plan.real_chunks > 1
    metrics = {name: roll_up(r) for name, r in results.items()}
    assert metrics["whole"]["grpo/epoch2/clip_frac"] > 0  # the clip binds in the second epoch
    for name in ("fixed", "budget"):
        delta = max_rel_delta(before, params_of(toys["whole"].model), params_of(toys[name].model))
        assert delta <= 1e-12, f"{loss_type}/{ratio_level}/{loss} {name}: max relative delta {delta:.2e}"
        for metric in ("grpo/loss", "grpo/denom", "grpo/seqs", "grpo/clip_frac_low", "grpo/clip_frac_high"):
            assert metrics[name][metric] == pytest.approx(metrics["whole"][metric], rel=1e-12, abs=1e-15), metric


@pytest.mark.parametrize("loss_type,ratio_level,loss", COMBOS)
def test_one_chunk_is_bit_identical_to_the_whole_batch_objective_call(loss_type, ratio_level, loss):
    batch = synthetic_batch(UNEQUAL, seed=1)
    obj = GRPOObjective(0.2, 0.28, loss_type=loss_type, ratio_level=ratio_level, loss=loss, max_completion_length=6)
    toy = make_toy(Split(rows=8), Needs(), objective=obj)
    toy.updater.update(batch)
    reference = make_toy(objective=obj).model  # the same seed: the same start
    logprobs = score(reference, batch)
    obj(logprobs, batch.completion_mask[:, 1:], batch.advantages)[0].backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), toy.model.parameters()))
