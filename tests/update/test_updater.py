"""The Updater without Lightning: a bare model and optimizer drive one update; splits stay exact; records extend."""

import subprocess
import sys

import pytest
import torch
from helpers import max_rel_delta, output_norm_capture, params_of, synthetic_batch
from transformers import AutoModelForCausalLM

from lightning_grpo.logprobs import token_logprobs
from lightning_grpo.objectives import PolicyView
from lightning_grpo.objectives.grpo import GRPOObjective
from lightning_grpo.update import AheadPass, Needs, Split, Updater

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier

LENS = [3, 9, 1, 6, 12, 2, 5, 8, 4, 10, 7, 11, 6, 2, 9, 3]  # 16 unequal completions
UNEQUAL = [1, 12, 3, 20, 2, 7, 15, 4]  # test_accumulate's batch: chunk token counts differ a lot


def bare(policy_dir, split: Split, needs: Needs | None = None, recorders=lambda model: []):
    """An Updater over a plain transformers model in float64: no Trainer, no LightningModule."""
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float64).train()
    score = lambda c: token_logprobs(model, c.input_ids, c.attention_mask, positions=c.completion_mask[:, 1:])
    view = PolicyView(model=model, temperature=1.0, logprobs=score, reference=None, call=lambda fn, *a: fn(*a))
    objective = GRPOObjective(epsilon=0.2)
    updater = Updater(model, lambda chunk, old: objective.chunk_loss(chunk, view, old), split, needs or Needs(),
                      ahead=AheadPass(model, score, recorders=recorders(model)))
    updater.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    return updater


@pytest.mark.parametrize("split", [Split(rows=8, n_micro=4), Split(rows=8, max_tokens_per_micro=40),
                                   Split(rows=8, n_micro=2, mu_iterations=2)],
                         ids=["fixed", "token-budget", "inner-epochs"])
def test_bare_updater_chunked_equals_unchunked_in_float64(tiny_policy_dir, split):
    batch = synthetic_batch(UNEQUAL, seed=1)
    whole = bare(tiny_policy_dir, Split(rows=8, mu_iterations=split.mu_iterations), Needs(pi_old=True))
    chunked = bare(tiny_policy_dir, split, Needs(pi_old=True))
    before = params_of(whole.policy)
    whole.update(batch)
    result = chunked.update(batch)
    assert len(result.steps) == split.mu_iterations and not any(s.skipped for s in result.steps)
    assert chunked.last_plan.real_chunks > 1  # really split
    assert max_rel_delta(before, params_of(whole.policy), params_of(chunked.policy)) < 1e-12  # float64
    assert chunked.state_dict()["loop_progress"]["loop_step"] == 1


def test_update_before_attach_is_refused(tiny_policy_dir):
    updater = bare(tiny_policy_dir, Split(rows=16))
    updater.loop = None
    with pytest.raises(RuntimeError, match="attach"):
        updater.update(synthetic_batch(LENS))


def test_update_package_imports_no_lightning():
    code = "import sys, lightning_grpo.update; print(sorted(m for m in sys.modules if m.split('.')[0] == 'lightning'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


# -- the docs/update.md example: a new per-token record is one class ------------------------------------------------
class HiddenNorm:
    """Records the L2 norm of the last hidden state at every token (``[T]`` per row)."""

    name, token_dim = "hidden_norm", 0

    def __init__(self, model):
        self.norm = model.model.norm  # the decoder's final norm: its output is the last hidden state

    def capture(self):
        return output_norm_capture(self.norm)  # cap.value: [B, T] once the forward ran

    def split(self, value, rows, lengths):
        return [value[i, : lengths[r]].clone() for i, r in enumerate(rows)]


def test_a_new_recorder_is_recorded_per_row_and_laid_out_per_chunk(tiny_policy_dir):
    batch = synthetic_batch(LENS, seed=4)
    updater = bare(tiny_policy_dir, Split(rows=16, n_mini=2, n_micro=2), Needs(records=True, every_chunk=True),
                   recorders=lambda model: [HiddenNorm(model)])
    updater.update(batch)
    record = updater.ahead.records["hidden_norm"]
    assert sorted(record.by_row) == list(range(16))  # every row, mini-batch 0 included
    rows = updater.last_plan.rows[1][0]
    width = int(batch.attention_mask[list(rows)].sum(-1).max())
    with torch.no_grad():
        fresh = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float64).eval()
        hidden = fresh.model(batch.input_ids[list(rows), :width], attention_mask=batch.attention_mask[list(rows), :width])
    want = hidden.last_hidden_state.norm(dim=-1) * batch.attention_mask[list(rows), :width]  # [B, W], 0 past a row
    torch.testing.assert_close(record.layout(rows, width), want, rtol=1e-12, atol=1e-12)
