"""Complete, atomic checkpoints at the batch boundary, and a resume after kill -9 that continues bit-identically."""

import csv
import io
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import TINY_JOB, StepRecorder, fit_tiny, global_determinism_restored, tiny_grpo_module
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

import lightning_grpo.checkpoint.checkpoint_io as checkpoint_io_mod
from lightning_grpo.checkpoint import (
    AtomicCheckpointIO,
    GRPOCheckpoint,
    Preempted,
    checkpoint_name,
    complete_checkpoints,
    config_path,
    find_last_checkpoint,
    loop_step_of,
    manifest_path,
    read_manifest,
    resolve_ckpt_path,
)
from lightning_grpo.checkpoint.state import LoopState, gather_rng_states, rng_state
from lightning_grpo.module import GRPOModule
from lightning_grpo.timing import is_timing

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier

TESTS = Path(__file__).parents[1]
LOOP_STEPS = 4


@pytest.fixture(autouse=True)
def _restore_switches():
    with global_determinism_restored():
        yield


# -- the atomic writer -----------------------------------------------------------------------------------------------
def test_exception_inside_the_writer_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    io, first = AtomicCheckpointIO(), tmp_path / checkpoint_name(1)
    io.save_checkpoint({"w": torch.arange(4)}, first)

    def torn(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full (injected)")

    monkeypatch.setattr(checkpoint_io_mod.torch, "save", torn)
    for target in (first, tmp_path / checkpoint_name(2)):  # overwrite the same name, and write the next one
        with pytest.raises(OSError, match="injected"):
            io.save_checkpoint({"w": torch.zeros(4)}, target)
    assert torch.equal(io.load_checkpoint(first)["w"], torch.arange(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no torn file, no temp file left


def test_kill9_while_writing_leaves_the_previous_checkpoint(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint({"w": torch.arange(4)}, tmp_path / checkpoint_name(1))
    pid = os.fork()
    if pid == 0:  # child: SIGKILL itself half-way through writing loop step 2
        def dying(obj, f):
            f.write(b"x" * 4096)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = dying
        io.save_checkpoint({"w": torch.zeros(4)}, tmp_path / checkpoint_name(2))
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert [p.name for p in tmp_path.glob(".*.tmp-*")] == [f".{checkpoint_name(2)}.tmp-{pid}"]  # the torn bytes
    assert complete_checkpoints(tmp_path) == [tmp_path / checkpoint_name(1)] == [find_last_checkpoint([tmp_path])]
    assert torch.equal(io.load_checkpoint(find_last_checkpoint([tmp_path]))["w"], torch.arange(4))


def test_loading_never_unpickles_code(tmp_path):
    path = tmp_path / checkpoint_name(1)
    torch.save({"fn": SimpleNamespace(x=1)}, path)  # an arbitrary object: needs code to rebuild
    with pytest.raises(Exception, match="[Ww]eights only"):
        AtomicCheckpointIO().load_checkpoint(path, weights_only=False)


def test_every_rank_gets_its_own_rng_streams_back(monkeypatch):
    """Two ranks' states gathered (as under DDP), saved, loaded weights_only; rank 1 restores rank 1's streams."""
    import numpy as np

    import lightning_grpo.checkpoint.state as state_mod
    from lightning_grpo.update.accumulate import DeferredAccumulator
    from lightning_grpo.update.ahead import AheadPass
    from lightning_grpo.update.loop import CollectedBatchLoop
    from lightning_grpo.update.updater import Split, Updater

    def draw():
        return torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random(), random.gauss(0, 1)

    per_rank = []
    for r in (0, 1):
        torch.manual_seed(10 + r), np.random.seed(20 + r), random.seed(30 + r), random.gauss(0, 1)
        per_rank.append((rng_state(), draw()))
    parts = iter([[per_rank[0][0][k], per_rank[1][0][k]] for k in per_rank[0][0]])  # the keys in rng_state()'s order
    monkeypatch.setattr(state_mod, "_all_gather", lambda tensor, world_size: next(parts))  # "rank 1" answers too
    trainer = SimpleNamespace(world_size=2, global_rank=1, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    torch.manual_seed(10), np.random.seed(20), random.seed(30), random.gauss(0, 1)  # this process is "rank 0"
    weight = torch.zeros(1, requires_grad=True)
    loop = CollectedBatchLoop(DeferredAccumulator([weight], torch.optim.SGD([weight], lr=0.1), 1), None)
    probe = AheadPass(torch.nn.Linear(1, 1), score=None)
    state = {"loop_progress": loop.progress.state_dict(), "accumulator": loop.accumulator.state_dict(),
             "old_logprobs": probe.state_dict(), "data": None, "rng": gather_rng_states(trainer)}
    buffer = io.BytesIO()
    torch.save({"grpo": state}, buffer)
    buffer.seek(0)
    keeper = LoopState()
    keeper.load(torch.load(buffer, weights_only=True))
    updater = Updater(probe.model, None, Split(), ahead=probe)
    updater.loop = loop
    keeper.resume(trainer, updater, datamodule=None)
    keeper.step_started()  # where the module restores RNG: right before its first training_step
    assert draw() == per_rank[1][1]


# -- the callback ------------------------------------------------------------------------------------------------------
def test_constructor_validation_lists_every_problem():
    with pytest.raises(ValueError, match=r"GRPOCheckpoint\(every_n_loop_steps=-1: .*; keep_last=-2: "):
        GRPOCheckpoint(every_n_loop_steps=-1, keep_last=-2)


class FakeTrainer(SimpleNamespace):
    """Just what GRPOCheckpoint.save touches: one rank, a module with parameters, save_checkpoint."""

    def __init__(self, save_checkpoint, module):
        super().__init__(is_global_zero=True, world_size=1, global_step=0, callbacks=[], lightning_module=module,
                         max_steps=0, save_checkpoint=save_checkpoint, strategy=SimpleNamespace(checkpoint_io=None))


def fake_module(loop_step: int = 0) -> torch.nn.Module:
    module = torch.nn.Linear(2, 2)
    module.loop_step = loop_step
    return module


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded-folder"])
def test_cadence_counts_loop_steps_renames_finished_saves_and_keeps_the_last(tmp_path, sharded):
    saved = []

    def save_checkpoint(path, weights_only=None):  # a file (CheckpointIO), or a folder (FSDP2 sharded save)
        path = Path(path)
        assert path.name.startswith(".") and not path.exists()  # written under a staging name
        saved.append(path.name)
        if sharded:
            path.mkdir()
            (path / "shard0").write_bytes(b"x")
        else:
            path.write_bytes(b"ckpt")

    module = fake_module()
    trainer = FakeTrainer(save_checkpoint, module)
    cb = GRPOCheckpoint(dirpath=str(tmp_path), every_n_loop_steps=3, keep_last=2)
    cb.run_id = cb.lineage = "0123abcd"
    for step in range(1, 11):  # whatever n_mini is, the callback sees one call per loop step
        module.loop_step = step
        cb.on_train_batch_end(trainer, module, None, None, step - 1)
    cb.on_train_end(trainer, module)  # loop step 10 was not on the cadence: saved at the end
    assert saved == [f".{checkpoint_name(s, '0123abcd')}.staging" for s in (3, 6, 9, 10)]
    kept = complete_checkpoints(tmp_path)
    assert [p.name for p in kept] == [checkpoint_name(9, "0123abcd"), checkpoint_name(10, "0123abcd")]
    assert kept[-1] == cb.last_path and all(p.is_dir() == sharded for p in kept)
    assert sorted(tmp_path.iterdir()) == sorted([*kept, *map(config_path, kept), *map(manifest_path, kept)])
    manifest = read_manifest(kept[-1])
    assert (manifest.lineage, manifest.loop_step, manifest.reason) == ("0123abcd", 10, "train_end")


def test_last_is_the_newest_complete_checkpoint_across_run_versions(tmp_path):
    trainer = SimpleNamespace(callbacks=[], logger=SimpleNamespace(root_dir=str(tmp_path)), default_root_dir="x")
    assert resolve_ckpt_path("last", trainer) is None  # nothing yet: start from scratch (with a warning)
    old, new = tmp_path / "version_0" / "checkpoints", tmp_path / "version_1" / "checkpoints"
    for folder, steps in ((old, (4, 5)), (new, (6,))):
        folder.mkdir(parents=True)
        for s in steps:
            torch.save({"s": s}, folder / checkpoint_name(s))  # names of before run ownership: one lineage
            time.sleep(0.01)
    (new / f".{checkpoint_name(7)}.tmp-1").write_bytes(b"torn")
    assert resolve_ckpt_path("last", trainer) == str(new / checkpoint_name(6))
    assert resolve_ckpt_path("some/path.ckpt", trainer) == "some/path.ckpt"


def test_a_save_failing_mid_write_keeps_the_previous_checkpoint_and_resume_repeats_the_lost_step(
        tiny_policy_dir, tmp_path, monkeypatch):
    real_save, calls = torch.save, []

    def second_save_fails(obj, f):
        calls.append(1)
        if len(calls) == 2:
            f.write(b"half")
            raise OSError("injected failure while writing loop step 2")
        real_save(obj, f)

    monkeypatch.setattr(checkpoint_io_mod.torch, "save", second_save_fails)
    crashed, cb = StepRecorder(), GRPOCheckpoint(every_n_loop_steps=1, keep_last=0)
    with pytest.raises(OSError, match="injected"):
        fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path / "crashed", loop_steps=2, callbacks=[crashed, cb])
    monkeypatch.undo()
    first = cb.dirpath / checkpoint_name(1, cb.lineage)
    assert sorted(p.name for p in cb.dirpath.iterdir()) == sorted(
        [first.name, config_path(first).name, manifest_path(first).name, ".lock"])
    assert find_last_checkpoint([cb.dirpath]) == first
    saved = torch.load(first, weights_only=True)
    grpo = saved["grpo"]
    assert (saved["global_step"], grpo["loop_step"], grpo["data"]["next_prompt_id"]) == (2, 1, 2)  # n_mini = 2
    assert grpo["old_logprobs"]["probe"] is not None and len(grpo["rng"]) == 1
    assert yaml.safe_load(config_path(first).read_text())["model"]["rl"]["deterministic"] is True

    resumed, module = StepRecorder(), tiny_grpo_module(tiny_policy_dir)
    fit_tiny(module, tmp_path / "resumed", loop_steps=2, callbacks=[resumed, GRPOCheckpoint()], ckpt_path=first)
    assert resumed.prompt_ids == crashed.prompt_ids[1:] == [[2, 3]]
    assert _without_timings(resumed.metrics) == _without_timings(crashed.metrics[1:])
    assert module.updater.ahead.probe_passed and module.updater.loop.progress.loop_step == 2


# -- checkpoints Lightning writes itself: the module's own state makes them exact ------------------------------------
@pytest.fixture(scope="module")
def uninterrupted(tiny_policy_dir, tmp_path_factory):
    """The tiny job for LOOP_STEPS loop steps with a plain ModelCheckpoint after every loop step (n_mini = 2)."""
    with global_determinism_restored():
        rec, root = StepRecorder(), tmp_path_factory.mktemp("uninterrupted")
        ckpt = ModelCheckpoint(dirpath=root / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1)
        module = tiny_grpo_module(tiny_policy_dir)
        fit_tiny(module, root, loop_steps=LOOP_STEPS, callbacks=[rec, ckpt])
    return SimpleNamespace(rows=rec.metrics, prompt_ids=rec.prompt_ids, ckpt=root / "ckpt",
                           params={k: v.clone() for k, v in module.policy.state_dict().items()})


def assert_continues(uninterrupted, resumed: StepRecorder, module, from_loop_step: int) -> None:
    """Every later loop step equals the uninterrupted run's, row for row, and the final parameters are equal."""
    assert resumed.prompt_ids == uninterrupted.prompt_ids[from_loop_step:]
    assert _without_timings(resumed.metrics) == _without_timings(uninterrupted.rows[from_loop_step:])
    final = module.policy.state_dict()
    assert all(torch.equal(final[k], v) for k, v in uninterrupted.params.items())


def test_resume_from_a_plain_model_checkpoint_equals_the_uninterrupted_run(uninterrupted, tiny_policy_dir, tmp_path):
    """Issue 14's bug: a plain ModelCheckpoint restarted loop_step at 0, reused step 0's sampling seed, re-probed."""
    saved = uninterrupted.ckpt / "step=2.ckpt"  # "{step}": the logged step, the loop step (global_step 4)
    assert torch.load(saved, weights_only=True)["grpo"]["loop_step"] == 2
    resumed, module = StepRecorder(), tiny_grpo_module(tiny_policy_dir)
    calls = []
    module.configure_model()
    probe = module.updater.ahead._run_probe
    module.updater.ahead._run_probe = lambda *a: calls.append(1) or probe(*a)
    fit_tiny(module, tmp_path, loop_steps=LOOP_STEPS, callbacks=[resumed], ckpt_path=saved)
    assert_continues(uninterrupted, resumed, module, from_loop_step=2)
    assert [r["step"] for r in resumed.metrics] == [3.0, 4.0] and calls == []  # the x-axis goes on; no second probe


class FailingRewardAt(GRPOModule):
    """The tiny job whose reward server fails once, after generation in loop step ``fail_at`` (1-based)."""

    fail_at = 3

    def compute_rewards(self, rollouts):
        if self.loop_step + 1 == self.fail_at:
            raise ConnectionError("reward server unreachable (injected)")
        return super().compute_rewards(rollouts)


def test_resume_from_an_exception_checkpoint_redraws_the_failed_step(uninterrupted, tiny_policy_dir, tmp_path):
    """OnExceptionCheckpoint saves inside loop step 3 (its prompts drawn, nothing trained): the resume redoes it."""
    failing = tiny_grpo_module(tiny_policy_dir)
    failing.__class__ = FailingRewardAt
    on_exception = OnExceptionCheckpoint(dirpath=tmp_path / "crash")
    with pytest.raises(ConnectionError, match="injected"):
        fit_tiny(failing, tmp_path / "a", loop_steps=LOOP_STEPS, callbacks=[on_exception])
    saved = torch.load(tmp_path / "crash" / "on_exception.ckpt", weights_only=True)
    # step 3's prompts were drawn (the stream stood at 3) but never trained on: the checkpoint records the boundary
    assert (saved["grpo"]["loop_step"], saved["PromptDataModule"]["position"]) == (2, 2)
    resumed, module = StepRecorder(), tiny_grpo_module(tiny_policy_dir)
    fit_tiny(module, tmp_path / "b", loop_steps=LOOP_STEPS, callbacks=[resumed],
             ckpt_path=tmp_path / "crash" / "on_exception.ckpt")
    assert_continues(uninterrupted, resumed, module, from_loop_step=2)


# -- preemption: SIGTERM / SIGUSR1 save at the next batch boundary, then exit non-zero ------------------------------
class SignalAt(Callback):
    """Sends ``signum`` to this very process early in loop step ``at`` (logged number), or in the validation after it."""

    def __init__(self, signum: int, at: int, during: str = "train") -> None:
        self.signum, self.at, self.during = signum, at, during

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.during == "train" and pl_module.loop_step + 1 == self.at:
            os.kill(os.getpid(), self.signum)  # a real signal: the handler runs while the loop step goes on

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.during == "validation" and pl_module.loop_step == self.at and not trainer.sanity_checking:
            os.kill(os.getpid(), self.signum)


def test_sigterm_inside_a_loop_step_saves_its_boundary_exits_143_and_resumes_exactly(uninterrupted, tiny_policy_dir,
                                                                                   tmp_path):
    """Issue 20: SIGTERM exited 0 with no checkpoint (Lightning's SIGTERMException)."""
    cb = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=0)  # no schedule: only the emergency save
    with pytest.raises(Preempted) as stop:
        fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path, loop_steps=LOOP_STEPS,
                 callbacks=[SignalAt(signal.SIGTERM, at=3), cb])
    assert stop.value.code == 128 + signal.SIGTERM == 143 and stop.value.loop_step == 3
    saved = cb.dirpath / checkpoint_name(3, cb.lineage)
    assert stop.value.path == saved and read_manifest(saved).reason == "signal:SIGTERM"
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)  # fit ended: handlers put back

    resumed, module = StepRecorder(), tiny_grpo_module(tiny_policy_dir)
    last = resolve_ckpt_path("last", SimpleNamespace(callbacks=[GRPOCheckpoint(dirpath=str(cb.dirpath))]))
    fit_tiny(module, tmp_path / "b", loop_steps=LOOP_STEPS, callbacks=[resumed], ckpt_path=last)
    assert_continues(uninterrupted, resumed, module, from_loop_step=3)


def test_sigterm_during_the_final_validation_saves_through_the_handoff_window_and_prints_the_summary(
        tiny_policy_dir, tmp_path, capsys):
    """Issue 20: SIGTERM during the final validation lost the summary and the train-end checkpoint (exit 0)."""
    from lightning_grpo.handoff import HandoffCallback
    from lightning_grpo.summary import RunSummary

    handoff, cb = HandoffCallback(), GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=0)
    with pytest.raises(Preempted) as stop:
        fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path, loop_steps=2, val_size=4, val_check_interval=2,
                 check_val_every_n_epoch=None, num_sanity_val_steps=0,
                 callbacks=[SignalAt(signal.SIGTERM, at=2, during="validation"), RunSummary(plot=False), handoff, cb])
    assert stop.value.code == 143 and stop.value.loop_step == 2
    saved = torch.load(cb.dirpath / checkpoint_name(2, cb.lineage), weights_only=True)
    assert (saved["grpo"]["loop_step"], saved["global_step"]) == (2, 4)  # the final boundary
    # The save read the module inside the hand-off's window: validation had published (generate), the window put
    # the engine to sleep and the trainer back before the state was read.
    events = handoff.events
    last_generate = max(i for i, e in enumerate(events) if e == "generate")
    assert events[last_generate + 1:last_generate + 3] == ["engine.sleep", "trainer.onload"]
    out = capsys.readouterr().out
    assert "lightning-grpo run summary" in out and "loop steps       2" in out
    assert f"stopped          stopped by SIGTERM after loop step 2: emergency checkpoint {stop.value.path}" in out


def test_sigusr1_under_slurm_auto_requeue_runs_lightnings_requeue_at_the_boundary(tiny_policy_dir, tmp_path,
                                                                                 monkeypatch):
    """SLURM's requeue signal: Lightning's handler (hpc checkpoint + scontrol requeue) still runs, at the batch
    boundary instead of in the middle of a loop step, after our emergency save; the run exits 138."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key, value in {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NAME": "grpo",
                       "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(key, value)
    cb = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=0)
    with pytest.raises(Preempted) as stop:
        fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path / "root", loop_steps=LOOP_STEPS,
                 callbacks=[SignalAt(signal.SIGUSR1, at=2), cb], plugins=[SLURMEnvironment(auto_requeue=True)])
    assert stop.value.code == 128 + signal.SIGUSR1 and stop.value.loop_step == 2
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    hpc = torch.load(tmp_path / "root" / "hpc_ckpt_1.ckpt", weights_only=True)
    ours = torch.load(cb.dirpath / checkpoint_name(2, cb.lineage), weights_only=True)
    assert (hpc["grpo"]["loop_step"], hpc["global_step"]) == (ours["grpo"]["loop_step"], ours["global_step"]) == (2, 4)
    assert all(torch.equal(hpc["state_dict"][k], v) for k, v in ours["state_dict"].items())


def _without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not is_timing(k)} for r in rows]


# -- kill -9 and resume through the CLI --------------------------------------------------------------------------------
def _write_config(folder: Path, policy_dir: Path) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {"max_steps": LOOP_STEPS * 2, "accelerator": "cpu", "devices": 1, "enable_progress_bar": False,
                    "enable_model_summary": False,
                    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                               "init_args": {"save_dir": "runs", "name": "tiny"}}},
        "checkpoint": {"every_n_loop_steps": 1, "keep_last": 0},
        "model": {"policy": {"path": str(policy_dir)}, **TINY_JOB},
        "data": {"source": "builtin:arith", "val_size": 0},
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.yaml").write_text(yaml.safe_dump(config))
    return folder / "job.yaml"


class Forker:
    """Starts CLI runs through tests/cli_forker.py (the CLI imported once, each run a forked child process)."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
        self.proc = subprocess.Popen([sys.executable, str(TESTS / "cli_forker.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True)
        self.codes: dict[int, int] = {}

    def fit(self, folder: Path, *extra: str) -> int:
        self.proc.stdin.write("\t".join([str(folder), "fit", "--config", "job.yaml", *extra]) + "\n")
        self.proc.stdin.flush()
        while not (line := self.proc.stdout.readline()).startswith("started "):
            assert line, "tests/cli_forker.py died"
            self._note(line)
        return int(line.split()[1])

    def exit_codes(self, timeout: float) -> dict[int, int]:
        out, _ = self.proc.communicate(timeout=timeout)  # EOF: the forker waits for every run, then exits
        for line in out.splitlines():
            self._note(line)
        return self.codes

    def _note(self, line: str) -> None:
        if line.startswith("exited "):
            _, pid, code = line.split()
            self.codes[int(pid)] = int(code)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # the forker reaps its children, so a finished run disappears
    except ProcessLookupError:
        return False
    return True


def _rows(folder: Path, version: int) -> list[dict]:
    with open(folder / "runs" / "tiny" / f"version_{version}" / "metrics.csv") as f:
        return [{k: v for k, v in r.items() if not is_timing(k)} for r in csv.DictReader(f)]


def step_file(folder: Path, loop_step: int) -> Path:
    """The checkpoint of ``loop_step`` in ``folder`` (one lineage), or a path that does not exist."""
    found = list(folder.glob(f"loop-step-{loop_step:06d}-*.ckpt"))
    assert len(found) <= 1, found
    return found[0] if found else folder / "missing"


def _params(path: Path) -> dict:
    return torch.load(path, weights_only=True)["state_dict"]


@pytest.mark.slow
def test_kill9_or_sigterm_at_a_random_loop_step_then_resume_last_matches_the_uninterrupted_run(tiny_policy_dir,
                                                                                               tmp_path):
    """Three CLI runs side by side: A uninterrupted, B killed with SIGKILL, C sent SIGTERM (a real signal to a child
    process: C saves at the next batch boundary and exits 143); B and C resume with --ckpt_path last."""
    rng = random.Random()
    seed = rng.randrange(10**6)
    rng.seed(seed)
    a, b, c = tmp_path / "uninterrupted", tmp_path / "killed", tmp_path / "terminated"
    for folder in (a, b, c):
        _write_config(folder, tiny_policy_dir)
    forker = Forker()
    try:
        run_a = forker.fit(a)  # independent fresh runs, same seed
        # Signal B and C at a random moment of a random loop step, once their checkpoint of loop step k exists.
        # At most LOOP_STEPS - 3: SIGTERM takes effect at the next boundary, so a signal landing just after step k + 1's
        # checkpoint saves step k + 2, which must leave a step to resume (CI's fast machine hit k + 2 == LOOP_STEPS).
        k = rng.randint(1, LOOP_STEPS - 3)
        signalled = {}
        for folder, signum in ((b, signal.SIGKILL), (c, signal.SIGTERM)):
            # C starts only once B is signalled: started together, C finished its 4 loop steps (1.2 s on CI's fast
            # machine) while the test was still waiting for B's kill moment.
            run = signalled[folder] = forker.fit(folder)
            ckpts, deadline = folder / "runs" / "tiny" / "version_0" / "checkpoints", time.time() + 300
            while not step_file(ckpts, k).exists():
                assert _alive(run) and time.time() < deadline, (folder / "out.log").read_text()[-3000:]
                time.sleep(0.05)
            # A random moment of loop step k + 1, never past it: on an idle machine 2 s span several loop steps, and
            # a kill after the last checkpoint would leave nothing to resume.
            kill_at = time.time() + rng.uniform(0.0, 2.0)
            while time.time() < kill_at and not step_file(ckpts, k + 1).exists():
                time.sleep(0.01)
            os.kill(run, signum)
        run_b, run_c = signalled[b], signalled[c]
        for run in (run_b, run_c):
            while _alive(run):
                time.sleep(0.05)
        survivors = {folder: complete_checkpoints(folder / "runs" / "tiny" / "version_0" / "checkpoints")
                     for folder in (b, c)}
        resumed = {folder: forker.fit(folder, "--ckpt_path", "last") for folder in (b, c)}
        codes = forker.exit_codes(timeout=600)
    finally:
        forker.proc.kill()
    assert codes[run_b] == -signal.SIGKILL, f"run B ended before the kill (seed {seed})"
    assert codes[run_c] == 128 + signal.SIGTERM, (c / "out.log").read_text()[-3000:]
    assert codes[run_a] == 0, (a / "out.log").read_text()[-3000:]
    for folder in (b, c):
        assert codes[resumed[folder]] == 0, (folder / "out.log").read_text()[-3000:]
    c_log = (c / "out.log").read_text()
    c_saved = survivors[c][-1]
    assert read_manifest(c_saved).reason in ("signal:SIGTERM", "scheduled")  # scheduled: the signal came at its save
    named = c_saved.relative_to(c)  # the config's folders are relative to the run's working directory
    assert f"stopped by SIGTERM after loop step {loop_step_of(c_saved)}: emergency checkpoint {named}" in c_log
    assert f"ckpt_path='last': resuming run {read_manifest(c_saved).lineage} from {named}" in c_log

    full = _rows(a, 0)
    assert [int(r["step"]) for r in full] == list(range(1, LOOP_STEPS + 1))
    assert float(full[-1]["grpo/grad_norm"]) > 0
    a_ckpts = a / "runs" / "tiny" / "version_0" / "checkpoints"
    for folder in (b, c):
        resumed_from, after = loop_step_of(survivors[folder][-1]), _rows(folder, 1)
        assert [int(r["step"]) for r in after] == list(range(resumed_from + 1, LOOP_STEPS + 1)), f"seed {seed}"
        assert after == full[resumed_from:], f"seed {seed}: {folder.name}'s resumed metrics differ from the full run"
        # Parameters: equal where the fresh runs overlap, and at the end of the resumed run.
        for step, other in ((resumed_from, folder / "runs" / "tiny" / "version_0" / "checkpoints"),
                            (LOOP_STEPS, folder / "runs" / "tiny" / "version_1" / "checkpoints")):
            pa, pb = _params(step_file(a_ckpts, step)), _params(step_file(other, step))
            assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa), f"step {step}, seed {seed}"
    final = torch.load(step_file(a_ckpts, LOOP_STEPS), weights_only=True)
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "PromptDataModule", "grpo"} <= final.keys()
    assert final["global_step"] == 2 * LOOP_STEPS and final["grpo"]["data"]["next_prompt_id"] == 2 * LOOP_STEPS
    assert all(config_path(p).is_file() for p in complete_checkpoints(a_ckpts))
