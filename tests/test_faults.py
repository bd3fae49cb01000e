"""Faults that used to lose data (issue 31): a metrics row behind a published checkpoint, an interrupted validation,
a signal while a reward call hangs, an error mid-run, a second run in the same folder, an unverified checkpoint."""

import csv
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import reward_fns
import torch
from helpers import StepRecorder, fit_tiny, forked_context, global_determinism_restored, tiny_grpo_module
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger
from test_resume import SignalAt, _without_timings

from lightning_grpo.checkpoint import GRPOCheckpoint, Preempted, checkpoint_name, read_manifest
from lightning_grpo.checkpoint.signals import StopRequested
from lightning_grpo.data.reward_calls import RewardError
from lightning_grpo.data.rewards import RewardSpec

pytestmark = pytest.mark.heavy  # kill -9 children and cut-short fits: CI and `make test-integration`


@pytest.fixture(autouse=True)
def _restore_switches():
    with global_determinism_restored():
        yield


def csv_rows(root: Path) -> list[dict]:
    """Every metrics.csv row under ``root`` (all versions, oldest first), blank cells dropped."""
    rows = []
    for path in sorted(root.rglob("metrics.csv")):
        with open(path) as f:
            rows += [{k: v for k, v in r.items() if v != ""} for r in csv.DictReader(f)]
    return rows


def train_steps(rows: list[dict]) -> list[int]:
    return [int(r["step"]) for r in rows if "grpo/loss" in r]


def val_steps(rows: list[dict]) -> list[int]:
    return [int(r["step"]) for r in rows if "val/reward" in r]


def in_child(target, *args) -> int:
    """Run ``target(*args)`` in a fresh process forked from the session's fork server (``helpers.forked_context``);
    its exit code (negative: killed by that signal).

    Not ``os.fork``: a fork of a process whose torch/OpenMP threads already ran can deadlock on a lock a thread held.
    """
    child = forked_context().Process(target=target, args=args)
    child.start()
    child.join(timeout=600)
    assert child.exitcode is not None, "the child run hung"
    return child.exitcode


class KillWhenPublished(Callback):
    """SIGKILLs this process at the first hook (after GRPOCheckpoint's) that finds loop step ``at``'s checkpoint."""

    def __init__(self, folder: Path, at: int, lineage_of: GRPOCheckpoint) -> None:
        self.folder, self.at, self.cb = folder, at, lineage_of

    def _check(self, *args, **kwargs) -> None:
        if self.cb.lineage and (self.folder / checkpoint_name(self.at, self.cb.lineage)).exists():
            os.kill(os.getpid(), signal.SIGKILL)

    on_train_batch_end = on_train_batch_start = on_validation_start = on_train_epoch_end = on_train_end = _check


def logged(root: Path) -> dict:
    """A CSVLogger writing one row per loop step, as the CLI's (``log_every_n_steps: 1``)."""
    return {"logger": CSVLogger(root, name="run"), "log_every_n_steps": 1}


# -- fault 1: the loop step's row is written before its checkpoint is published (or its signal acted on) ----------
def _fit_killed_at_publish(policy_dir: Path, root: Path) -> None:
    cb = GRPOCheckpoint(dirpath=str(root / "ckpt"), every_n_loop_steps=1, keep_last=0)
    fit_tiny(tiny_grpo_module(policy_dir), root, loop_steps=4, **logged(root),
             callbacks=[cb, KillWhenPublished(root / "ckpt", 2, cb)])


def test_kill9_the_moment_a_checkpoint_is_published_leaves_its_metrics_row(tiny_policy_dir, tmp_path):
    assert in_child(_fit_killed_at_publish, tiny_policy_dir, tmp_path) == -signal.SIGKILL
    assert [p.name[:16] for p in sorted((tmp_path / "ckpt").glob("loop-step-*.ckpt"))] == [
        "loop-step-000001", "loop-step-000002"]
    assert train_steps(csv_rows(tmp_path)) == [1, 2]  # row 2 was on disk before checkpoint 2 existed


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_the_signalled_loop_steps_row_is_logged_before_the_run_stops(tiny_policy_dir, tmp_path, signum):
    cb = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=0)
    with pytest.raises(Preempted) as stop:
        fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path, loop_steps=4, **logged(tmp_path),
                 callbacks=[SignalAt(signum, at=2), cb])
    assert stop.value.loop_step == 2 and stop.value.code == 128 + signum
    assert train_steps(csv_rows(tmp_path)) == [1, 2]
    assert read_manifest(cb.dirpath / checkpoint_name(2, cb.lineage)).reason == f"signal:{signal.Signals(signum).name}"


# -- fault 2: a validation interrupted by a signal or kill -9 runs again when the run resumes -----------------------
VAL = {"val_size": 4, "val_check_interval": 2, "check_val_every_n_epoch": None, "num_sanity_val_steps": 0}


class KillInValidation(Callback):
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if pl_module.loop_step == 2:
            os.kill(os.getpid(), signal.SIGKILL)


def _fit_cut_in_validation(policy_dir: Path, root: Path, how: str) -> None:
    stopper = SignalAt(signal.SIGTERM, at=2, during="validation") if how == "sigterm" else KillInValidation()
    fit_tiny(tiny_grpo_module(policy_dir), root, loop_steps=4, **logged(root), **VAL,
             callbacks=[stopper, GRPOCheckpoint(dirpath=str(root / "ckpt"), every_n_loop_steps=2)])


@pytest.fixture(scope="module")
def validated_rows(tiny_policy_dir, tmp_path_factory) -> list[dict]:
    """The validation rows of the tiny job run whole for 4 loop steps, validating after 2 and 4 (one run serves both
    ways of cutting the validation short)."""
    full = tmp_path_factory.mktemp("validated")
    with global_determinism_restored():
        fit_tiny(tiny_grpo_module(tiny_policy_dir), full, loop_steps=4, **logged(full), **VAL)
    return [r for r in csv_rows(full) if "val/reward" in r]


def _cut_in_validation(policy_dir: Path, root: Path, how: str) -> int:
    """The run's exit code: SIGTERM in this process (the stop is a Preempted, code 143), kill -9 in a child."""
    if how == "kill9":
        return in_child(_fit_cut_in_validation, policy_dir, root, how)
    with pytest.raises(Preempted) as stop:
        _fit_cut_in_validation(policy_dir, root, how)
    return stop.value.code


@pytest.mark.parametrize("how", ["sigterm", "kill9"])
def test_a_validation_cut_short_runs_again_first_when_the_run_resumes(validated_rows, tiny_policy_dir, tmp_path, how):
    expected = validated_rows
    assert val_steps(expected) == [2, 4]

    cut, ckpt = tmp_path / "cut", tmp_path / "cut" / "ckpt"
    assert _cut_in_validation(tiny_policy_dir, cut, how) == (143 if how == "sigterm" else -signal.SIGKILL)
    saved = next(ckpt.glob("loop-step-000002-*.ckpt"))
    assert read_manifest(saved).validation == "pending"
    assert val_steps(csv_rows(cut)) == []  # the validation after step 2 never finished

    fit_tiny(tiny_grpo_module(tiny_policy_dir), cut, loop_steps=4, **logged(cut), **VAL, ckpt_path=saved,
             callbacks=[GRPOCheckpoint(dirpath=str(ckpt), every_n_loop_steps=2)])
    rows = csv_rows(cut)
    assert train_steps(rows) == [1, 2, 3, 4] and val_steps(rows) == [2, 4]
    got = [r for r in rows if "val/reward" in r]
    assert [r["val/reward"] for r in got] == [r["val/reward"] for r in expected]
    assert read_manifest(next(ckpt.glob("loop-step-000004-*.ckpt"))).validation == "done"


def test_a_finished_validation_is_not_run_again_on_resume(tiny_policy_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path, loop_steps=2, **logged(tmp_path), **VAL,
             callbacks=[GRPOCheckpoint(dirpath=str(ckpt), every_n_loop_steps=2)])
    saved = next(ckpt.glob("loop-step-000002-*.ckpt"))
    assert read_manifest(saved).validation == "done"
    fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path, loop_steps=4, **logged(tmp_path), **VAL,
             ckpt_path=saved, callbacks=[GRPOCheckpoint(dirpath=str(ckpt), every_n_loop_steps=2)])
    assert val_steps(csv_rows(tmp_path)) == [2, 4]


# -- faults 3 and 12: a signal while a reward call hangs, and an error mid-run, save the last batch boundary ---------
def hanging_module(policy_dir, timeout_s):
    module = tiny_grpo_module(policy_dir)
    module.reward_specs = [*module.reward_specs, RewardSpec("reward_fns:hangs_from_prompt_4", timeout_s=timeout_s)]
    return module


@pytest.fixture(scope="module")
def released_run(tiny_policy_dir, tmp_path_factory):
    """The job with the hanging reward released, run whole for 4 loop steps: its StepRecorder and final weights. One
    run serves both timeouts: a released call returns at once, so timeout_s changes nothing in it."""
    reward_fns.RELEASE.set()
    full, module = StepRecorder(), hanging_module(tiny_policy_dir, None)
    with global_determinism_restored():
        fit_tiny(module, tmp_path_factory.mktemp("released"), loop_steps=4, callbacks=[full])
    return full, {k: v.clone() for k, v in module.policy.state_dict().items()}


@pytest.mark.parametrize("timeout_s", [None, 600.0])
def test_sigterm_while_a_reward_call_hangs_saves_the_boundary_and_the_resume_is_exact(released_run, tiny_policy_dir,
                                                                                     tmp_path, timeout_s):
    full, expected = released_run
    reward_fns.RELEASE.clear()
    cb = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=0)
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM))
    try:
        # Loop step 3's reward call hangs; the SIGTERM comes 1 s after that loop step began, while it waits.
        with pytest.raises(StopRequested) as stop:
            fit_tiny(hanging_module(tiny_policy_dir, timeout_s), tmp_path / "cut", loop_steps=4,
                     callbacks=[SignalWhenHanging(timer), cb])
        waited = time.monotonic() - timer.started_at
    finally:
        timer.cancel()
        reward_fns.RELEASE.set()
    assert stop.value.code == 143 and waited < 5  # the wait ended within a poll, whatever timeout_s is
    saved = cb.dirpath / checkpoint_name(2, cb.lineage)
    assert read_manifest(saved).reason == "signal:SIGTERM"

    resumed, module = StepRecorder(), hanging_module(tiny_policy_dir, timeout_s)
    fit_tiny(module, tmp_path / "resumed", loop_steps=4, callbacks=[resumed], ckpt_path=saved)
    assert resumed.prompt_ids == full.prompt_ids[2:]
    assert _without_timings(resumed.metrics) == _without_timings(full.metrics[2:])
    assert all(torch.equal(module.policy.state_dict()[k], v) for k, v in expected.items())


class SignalWhenHanging(Callback):
    """Starts ``timer`` when loop step 3 begins (its reward call is the one that hangs)."""

    def __init__(self, timer: threading.Timer) -> None:
        self.timer = timer

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.loop_step == 2:
            self.timer.started_at = time.monotonic()
            self.timer.start()


@pytest.mark.parametrize("save_on_signal", [True, False])
def test_an_error_mid_run_saves_an_emergency_checkpoint_of_the_last_boundary(tiny_policy_dir, tmp_path,
                                                                            save_on_signal):
    """Fault 12: a reward error at loop step 3 lost everything since the last scheduled save (here: none)."""
    module = tiny_grpo_module(tiny_policy_dir)
    module.reward_specs = [*module.reward_specs, RewardSpec("reward_fns:hangs_from_prompt_4", timeout_s=0.2)]
    reward_fns.RELEASE.clear()
    cb = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=10, save_on_signal=save_on_signal)
    try:
        with pytest.raises(RewardError, match="did not return within timeout_s=0.2"):
            fit_tiny(module, tmp_path, loop_steps=4, callbacks=[cb])
    finally:
        reward_fns.RELEASE.set()
    saved = cb.dirpath / checkpoint_name(2, cb.lineage)
    assert read_manifest(saved).reason == "error:RewardError"
    state = torch.load(saved, weights_only=True)
    assert (state["grpo"]["loop_step"], state["global_step"], state["PromptDataModule"]["position"]) == (2, 4, 2)


def test_an_error_after_the_update_stepped_saves_nothing(tiny_policy_dir, tmp_path, caplog):
    """Parameters already moved inside the loop step: a checkpoint would not be a boundary, so none is written."""

    class FailsAfterStepping(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if pl_module.loop_step == 2 and trainer.global_step == 5:
                raise RuntimeError("injected after one optimizer step of loop step 3")

    cb = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=10)
    with pytest.raises(RuntimeError, match="injected"):
        fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path, loop_steps=4, callbacks=[FailsAfterStepping(), cb])
    assert not list(cb.dirpath.glob("loop-step-*.ckpt"))
    assert "no emergency checkpoint of loop step 2 (the update had already stepped)" in caplog.text


# -- fault 6: a checkpoint without its manifest is checked for the marks of a damaged float -----------------------
def test_a_checkpoint_without_manifest_and_a_flipped_exponent_byte_is_refused(tiny_policy_dir, tmp_path, caplog):
    from lightning_grpo.checkpoint import AtomicCheckpointIO, DamagedCheckpointError, manifest_path

    cb = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=2)
    fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path, loop_steps=2, callbacks=[cb])
    saved = cb.dirpath / checkpoint_name(2, cb.lineage)
    manifest_path(saved).unlink()
    io = AtomicCheckpointIO()
    assert io.load_checkpoint(saved)["grpo"]["loop_step"] == 2  # intact: loads, with a warning
    assert "has no manifest" in caplog.text and "unverified" in caplog.text

    state = torch.load(saved, weights_only=True)
    moment = next(iter(state["optimizer_states"][0]["state"].values()))["exp_avg"]
    moment.view(-1)[0] = 7e32  # what one flipped exponent byte made of an Adam moment of 2e-6
    damaged = tmp_path / "damaged.ckpt"
    torch.save(state, damaged)
    with pytest.raises(DamagedCheckpointError, match=r"no manifest to verify it.*'exp_avg' holds 7e\+32"):
        io.load_checkpoint(damaged)


def test_a_stopped_server_hands_sigterm_back_and_a_wrapped_handler_stays_inert(tmp_path):
    """A launched `vllm serve` installs a SIGTERM handler that stops it. Once the last server stopped, it must not
    outlive it: the previous handler comes back, and where something wrapped it meanwhile (Lightning, GRPOCheckpoint),
    it does nothing, so a later fit's graceful SIGTERM stop is not turned into a kill (it killed pytest itself)."""
    from lightning_grpo.rollout.server import orphans
    from lightning_grpo.rollout.server import process as sp
    from lightning_grpo.rollout.server_config import ServerConfig

    before = signal.getsignal(signal.SIGTERM)
    first = sp.ServerProcess(str(tmp_path), ServerConfig(), "raw_logprobs")  # never spawned: stop() still untracks
    orphans.track(first)
    assert signal.getsignal(signal.SIGTERM) is orphans._on_sigterm
    first.stop()
    assert signal.getsignal(signal.SIGTERM) == before
    second = sp.ServerProcess(str(tmp_path), ServerConfig(), "raw_logprobs")
    orphans.track(second)
    seen = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))  # a wrapper, as SignalWatch installs
    try:
        second.stop()
        orphans._on_sigterm(signal.SIGTERM, None)  # the wrapper forwarding the signal: no server, so nothing happens
        assert seen == [] and orphans._SIGTERM["installed"]
    finally:
        signal.signal(signal.SIGTERM, orphans._on_sigterm)
        orphans._release_sigterm()
    assert signal.getsignal(signal.SIGTERM) == before
