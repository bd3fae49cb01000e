"""Runs with non-finite values, end to end (issue 20): skipped loop steps log honest rows, identical after a resume;
an always-NaN run stops past rl.max_consecutive_skips naming the chunk; poisoned weights are never checkpointed."""

import csv
import logging
import math
import signal
from pathlib import Path

import pytest
import torch
from helpers import StepRecorder, fit_tiny, global_determinism_restored, tiny_grpo_module
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_grpo.checkpoint import GRPOCheckpoint, NonFiniteParametersError, checkpoint_name, complete_checkpoints
from lightning_grpo.module import GRPOModule
from lightning_grpo.timing import is_timing
from lightning_grpo.update.loop import NonFiniteRunError

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier


@pytest.fixture(autouse=True)
def _restore_switches():
    with global_determinism_restored():
        yield


class NaNLossAt(GRPOModule):
    """The tiny job whose every chunk loss is NaN in the loop steps ``nan_at`` (logged step numbers)."""

    nan_at: frozenset = frozenset({2})

    def forward_chunk(self, chunk, old_logprobs):
        loss, denom, stats = super().forward_chunk(chunk, old_logprobs)
        return (loss * math.nan if self.loop_step + 1 in self.nan_at else loss), denom, stats


def nan_module(policy_dir, nan_at) -> GRPOModule:
    module = tiny_grpo_module(policy_dir)
    module.__class__ = NaNLossAt
    module.nan_at = frozenset(nan_at)
    return module


def csv_rows(logger: CSVLogger) -> list[dict]:
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        return [{k: v for k, v in r.items() if not is_timing(k)} for r in csv.DictReader(f)]


def test_a_fully_skipped_loop_step_logs_nan_not_the_previous_row_and_a_resume_across_it_logs_identical_rows(
        tiny_policy_dir, tmp_path):
    """Issue 20: the CSV row of a skipped loop step repeated the previous step's grpo/loss, grad_norm, n, tokens, lr
    (Lightning re-logs cached values for missing keys); a resumed run logged blanks there instead."""
    whole_log, cb = CSVLogger(tmp_path / "whole"), GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=1,
                                                                  keep_last=0)
    fit_tiny(nan_module(tiny_policy_dir, {2}), tmp_path, loop_steps=4, callbacks=[cb], logger=whole_log,
             log_every_n_steps=1)
    whole = csv_rows(whole_log)
    # max_steps counts optimizer steps taken (4 x n_mini = 8): loop step 2 took none, so a fifth loop step ran
    assert [r["step"] for r in whole] == ["1", "2", "3", "4", "5"]
    skipped, before = whole[1], whole[0]
    for name in ("grpo/loss", "grpo/grad_norm", "grpo/lr", "grpo/clip_frac", "grpo/kl"):
        assert skipped[name] == "nan", (name, skipped[name], before[name])
    assert (skipped["grpo/n"], skipped["grpo/tokens"], skipped["grpo/skipped_windows"]) == ("0.0", "0.0", "2.0")
    assert skipped["grpo/consecutive_skips"] == "2.0" and whole[2]["grpo/consecutive_skips"] == "0.0"
    assert all(v != "" for r in whole for v in r.values())  # no blank cell either

    # Resume from loop step 1 across the NaN step: the same rows, cell for cell.
    resumed_log = CSVLogger(tmp_path / "resumed")
    fit_tiny(nan_module(tiny_policy_dir, {2}), tmp_path, loop_steps=4, logger=resumed_log, log_every_n_steps=1,
             callbacks=[GRPOCheckpoint(dirpath=str(tmp_path / "ckpt2"))],
             ckpt_path=cb.dirpath / checkpoint_name(1, cb.lineage))
    assert csv_rows(resumed_log) == whole[1:]


class Guard(Callback):
    """Fails a run that goes past ``limit`` loop steps (on main an always-NaN run never ended)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        assert pl_module.loop_step < self.limit, f"run did not stop: loop step {pl_module.loop_step}"


def test_an_always_nan_run_stops_past_max_consecutive_skips_naming_the_chunk_and_saves_only_good_boundaries(
        tiny_policy_dir, tmp_path):
    """Issue 20: with a loss that is always NaN and max_steps=2 the run went on for 208 loop steps until killed."""
    cb = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=1, keep_last=0)
    on_exception = OnExceptionCheckpoint(dirpath=tmp_path / "crash")
    module = nan_module(tiny_policy_dir, range(1, 100))
    initial = {k: v.clone() for k, v in tiny_grpo_module(tiny_policy_dir).configure_policy()[0].state_dict().items()}
    with pytest.raises(NonFiniteRunError, match=r"rl.max_consecutive_skips=8: 9 optimizer steps in a row were skipped "
                                                r".* the last: non-finite loss in loop step 5, mini-batch 0, "
                                                r"micro-batch 0"):
        fit_tiny(module, tmp_path, loop_steps=1, callbacks=[Guard(12), cb, on_exception])  # max_steps = 2
    assert [int(p.name[10:16]) for p in complete_checkpoints(cb.dirpath)] == [1, 2, 3, 4]
    for path in [*complete_checkpoints(cb.dirpath), tmp_path / "crash" / "on_exception.ckpt"]:
        saved = torch.load(path, weights_only=True)
        assert saved["grpo"]["loop_step"] <= 4 and saved["global_step"] == 0  # boundaries; no step was ever taken
        assert all(torch.equal(saved["state_dict"][f"policy.{k}"], v) for k, v in initial.items())


class PoisonAt(Callback):
    """Writes NaN into the final norm's weight at the end of loop step ``at`` (a diverged optimizer step)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.loop_step == self.at:
            with torch.no_grad():
                pl_module.policy.model.norm.weight[0] = math.nan


def test_poisoned_weights_are_never_checkpointed_by_the_schedule_or_the_exception_path(tiny_policy_dir, tmp_path,
                                                                                       caplog):
    cb = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=1, keep_last=0)
    on_exception = OnExceptionCheckpoint(dirpath=tmp_path / "crash")
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="probability tensor contains"):
        fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path, loop_steps=4,
                 callbacks=[StepRecorder(), PoisonAt(2), cb, on_exception])  # loop step 3 samples from NaN logits
    assert "not saving loop step 2: parameter 'policy.model.norm.weight' holds NaN/inf" in caplog.text
    assert [p.name for p in complete_checkpoints(cb.dirpath)] == [checkpoint_name(1, cb.lineage)]
    # The checkpoint written on the way out holds no weights, says why, and refuses to load; the run's own failure
    # stayed the one raised, and Lightning's teardown ran (its signal handlers are gone).
    stub = torch.load(tmp_path / "crash" / "on_exception.ckpt", weights_only=True)
    assert "state_dict" not in stub and "optimizer_states" not in stub
    assert "parameter 'policy.model.norm.weight' holds NaN/inf" in stub["grpo"]["refused"]
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
    with pytest.raises(NonFiniteParametersError, match="holds no weights, they were refused when it was written"):
        fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path / "b", loop_steps=4,
                 ckpt_path=tmp_path / "crash" / "on_exception.ckpt")
