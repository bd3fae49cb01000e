"""Checkpoint ownership and integrity (issue 20): runs own their files, `last` picks the right run and an intact file,
two live runs never share a folder, and damaged or unwritable checkpoints end in a line that names the file."""

import logging
import os
import re
import signal
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import StepRecorder, fit_tiny, global_determinism_restored, tiny_grpo_module

import lightning_grpo.checkpoint.atomic as atomic_mod
from lightning_grpo.checkpoint import (
    AtomicCheckpointIO,
    DamagedCheckpointError,
    FolderInUseError,
    GRPOCheckpoint,
    checkpoint_name,
    complete_checkpoints,
    lineage_entries,
    loop_step_of,
    read_manifest,
    resolve_ckpt_path,
)
from lightning_grpo.checkpoint.lock import FolderLock


@pytest.fixture(autouse=True)
def _restore_switches():
    with global_determinism_restored():
        yield


def fit_into(folder: Path, policy_dir, loop_steps: int, ckpt_path=None, **kw) -> GRPOCheckpoint:
    """The tiny job saving every loop step into ``folder`` (keep_last=2); returns its checkpoint callback."""
    cb = GRPOCheckpoint(dirpath=str(folder), every_n_loop_steps=1, **{"keep_last": 2, **kw})
    rec = StepRecorder()
    fit_tiny(tiny_grpo_module(policy_dir), folder.parent / "root", loop_steps=loop_steps, callbacks=[rec, cb],
             ckpt_path=ckpt_path)
    cb.recorded = rec
    return cb


def trainer_for(folder: Path) -> SimpleNamespace:
    """What resolve_ckpt_path reads of a Trainer: its callbacks (a fresh GRPOCheckpoint on ``folder``)."""
    return SimpleNamespace(callbacks=[GRPOCheckpoint(dirpath=str(folder))], logger=None, default_root_dir=".")


def test_two_runs_sharing_a_dirpath_keep_their_own_checkpoints_and_resume_their_own(tiny_policy_dir, tmp_path,
                                                                                     caplog):
    """Issue 20: run B's saves were each pruned at once (run A had later loop steps) and `last` restored run A."""
    shared = tmp_path / "ckpt"
    a = fit_into(shared, tiny_policy_dir, loop_steps=4)
    b = fit_into(shared, tiny_policy_dir, loop_steps=2)  # a new run, same folder, fewer loop steps
    assert a.lineage != b.lineage
    mine = {cb.lineage: [loop_step_of(e.path) for e in lineage_entries([shared], cb.lineage)] for cb in (a, b)}
    assert mine == {a.lineage: [4, 3], b.lineage: [2, 1]}  # each run kept its own keep_last=2, newest first
    assert all(read_manifest(p).lineage in (a.lineage, b.lineage) for p in complete_checkpoints(shared))

    # `last` from a new process (a fresh Trainer): the run saved last is B, and the line says which file and run.
    caplog.clear()
    with caplog.at_level(logging.INFO):
        picked = resolve_ckpt_path("last", trainer_for(shared))
    assert picked == str(shared / checkpoint_name(2, b.lineage))
    err = caplog.text
    assert f"resuming run {b.lineage} from {picked}" in err and f"also holds run(s) {a.lineage}" in err

    # B resumed continues B's lineage: its files, its pruning; A's files are untouched.
    resumed = fit_into(shared, tiny_policy_dir, loop_steps=3, ckpt_path=picked)
    assert resumed.lineage == b.lineage and resumed.run_id != b.run_id
    assert read_manifest(resumed.last_path).parent == picked
    assert [loop_step_of(e.path) for e in lineage_entries([shared], b.lineage)] == [3, 2]
    assert [loop_step_of(e.path) for e in lineage_entries([shared], a.lineage)] == [4, 3]
    assert resumed.recorded.metrics[0]["step"] == 3.0  # continued from B's loop step 2, not A's 4


def test_a_second_live_run_in_the_folder_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path, caplog):
    folder = tmp_path / "ckpt"
    held = FolderLock(folder)
    held.acquire("11111111", "11111111")
    with pytest.raises(FolderInUseError, match=rf"{folder} is in use by another live run \(run 11111111 .* pid "
                                               rf"{os.getpid()} on host .*--checkpoint.dirpath"):
        FolderLock(folder).acquire("22222222", "22222222")
    held.release()
    FolderLock(folder).acquire("22222222", "22222222")  # released: free again (same process, new open file)

    folder2 = tmp_path / "ckpt2"
    pid = os.fork()
    if pid == 0:  # a run that holds the folder and dies without letting go
        FolderLock(folder2).acquire("33333333", "33333333")
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    with caplog.at_level(logging.INFO, logger="lightning_grpo.checkpoint.lock"):
        FolderLock(folder2).acquire("44444444", "44444444")
    assert f"took over the lock of a run that is gone (run 33333333 of lineage 33333333, pid {pid}" in caplog.text


def test_a_fit_into_a_folder_held_by_a_live_run_is_refused_before_training(tiny_policy_dir, tmp_path):
    folder = tmp_path / "ckpt"
    FolderLock(folder).acquire("55555555", "55555555")  # held by "another run" (this process) for the whole test
    rec = StepRecorder()
    with pytest.raises(FolderInUseError, match="run 55555555"):
        fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path / "root", loop_steps=1,
                 callbacks=[rec, GRPOCheckpoint(dirpath=str(folder), every_n_loop_steps=1)])
    assert rec.metrics == [] and complete_checkpoints(folder) == []


@pytest.fixture(scope="module")
def three_saves(tiny_policy_dir, tmp_path_factory):
    """A run that saved loop steps 1, 2, 3 (keep_last=0), each with its manifest."""
    with global_determinism_restored():
        return fit_into(tmp_path_factory.mktemp("saves") / "ckpt", tiny_policy_dir, loop_steps=3, keep_last=0)


def flip_a_byte(path: Path) -> None:
    """Flip one bit in the middle of the file (inside tensor data: torch.load would not notice)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_the_newest_checkpoint_makes_last_fall_back_with_a_log_line(three_saves, tmp_path, caplog,
                                                                                     tiny_policy_dir):
    """Issue 20: a flipped bit loaded without error (later `probability tensor contains inf/nan`, naming no file)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for p in three_saves.dirpath.iterdir():
        if not p.name.startswith("."):
            (folder / p.name).write_bytes(p.read_bytes())
    newest, previous = (folder / checkpoint_name(s, three_saves.lineage) for s in (3, 2))
    flip_a_byte(newest)
    assert torch.load(newest, weights_only=True)["grpo"]["loop_step"] == 3  # torch itself loads it happily

    with caplog.at_level(logging.WARNING):
        assert resolve_ckpt_path("last", trainer_for(folder)) == str(previous)
    assert f"checkpoint {newest} is damaged: its content hash" in caplog.text
    assert f"falling back to the previous checkpoint of run {three_saves.lineage}" in caplog.text

    with pytest.raises(DamagedCheckpointError, match=re.escape(f"checkpoint {newest} is damaged: ") + ".*"
                       + re.escape(f"resume from the previous checkpoint instead: {previous}")):
        AtomicCheckpointIO().load_checkpoint(newest)
    resumed = fit_into(folder, tiny_policy_dir, loop_steps=3, ckpt_path=str(previous))  # the fallback resumes
    assert resumed.recorded.metrics[0]["step"] == 3.0


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_empty_and_truncated_checkpoints_name_the_file_and_suggest_the_previous_one(three_saves, tmp_path, damage):
    """Issue 20: a 0-byte file gave a bare EOFError; with or without a manifest the error names file and fallback."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for p in three_saves.dirpath.iterdir():
        if not p.name.startswith("."):
            (folder / p.name).write_bytes(p.read_bytes())
    newest, previous = (folder / checkpoint_name(s, three_saves.lineage) for s in (3, 2))
    data = newest.read_bytes()
    newest.write_bytes(b"" if damage == "empty" else data[: len(data) // 3])
    why = "is empty (0 bytes)" if damage == "empty" else f"has {len(data) // 3} bytes but its manifest recorded"
    with pytest.raises(DamagedCheckpointError,
                       match=re.escape(f"{newest} {why}") + ".*" + re.escape(f"previous checkpoint instead: {previous}")):
        AtomicCheckpointIO().load_checkpoint(newest)
    # A copy without its manifest (a file handed around on its own) is still named, by its structure.
    alone = tmp_path / "alone" / checkpoint_name(7)
    alone.parent.mkdir()
    alone.write_bytes(newest.read_bytes())
    why = "is empty" if damage == "empty" else "is truncated or not a torch checkpoint"
    with pytest.raises(DamagedCheckpointError, match=re.escape(f"checkpoint {alone} {why}") + ".*no earlier checkpoint"):
        AtomicCheckpointIO().load_checkpoint(alone)


def test_disk_full_ends_with_no_space_left_on_device_and_the_checkpoint_path(tiny_policy_dir, tmp_path, monkeypatch):
    """Issue 20: disk full ended with torch's `unexpected pos`; the real ENOSPC (from /dev/full) now names the file."""
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):  # every checkpoint write lands on a device with no space
        if "w" in mode and ".ckpt.staging.tmp-" in str(path):
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(atomic_mod, "open", full_disk, raising=False)
    cb = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=1)
    with pytest.raises(OSError) as err:
        fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path / "root", loop_steps=1, callbacks=[cb])
    last_line = traceback.format_exception_only(type(err.value), err.value)[-1].strip()
    assert last_line == f"OSError: [Errno 28] No space left on device: '{cb.dirpath / checkpoint_name(1, cb.lineage)}'"
    assert err.value.__cause__.errno == 28  # the OSError that torch swallowed, kept in the chain
    assert not any(p.name.startswith("loop-step") for p in cb.dirpath.iterdir())  # no torn file, no orphan config
