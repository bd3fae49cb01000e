"""RunSummary: what a person reads when a fit ends, and that it says what metrics.csv and curves.png say."""

from __future__ import annotations

import csv
import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from agreement import check_agreement
from helpers import fit_tiny, tiny_grpo_module

from lightning_grpo.checkpoint import GRPOCheckpoint, complete_checkpoints
from lightning_grpo.cli import main
from lightning_grpo.summary import RunSummary

pytestmark = pytest.mark.heavy  # a fit of every shipped config: CI and `make test-integration`


def test_quickstart_summary_prints_first_and_last_val_reward(quickstart_run):
    lines = quickstart_run.stdout.splitlines()
    first = next(line for line in lines if "val/reward first" in line)
    last = next(line for line in lines if "val/reward last" in line)
    # The config's num_sanity_val_steps: -1 validates every held-out prompt before training: loop step 0.
    assert re.search(r"val/reward first \d\.\d{3}  \(loop step 0\)", first)
    assert re.search(r"val/reward last  \d\.\d{3}  \(loop step 2, [+-]\d\.\d{3}; 3 validations\)", last)


def _validate(summary, module, value: float, sanity: tuple[int, int] | None = None) -> None:
    trainer = SimpleNamespace(sanity_checking=sanity is not None, callback_metrics={"val/reward": value},
                              num_sanity_val_batches=[sanity[0] if sanity else 0], num_val_batches=[8])
    summary.on_validation_end(trainer, module)


def _steps(summary, module, rewards: list[float]) -> None:
    for reward in rewards:
        module.loop_step += 1
        module.last_metrics = {"reward/mean": reward, "step": float(module.loop_step), "grpo/tokens": 10.0}
        summary.on_train_batch_end(None, module, None, None, 0)


def test_validations_are_labelled_with_the_loop_step_also_after_a_resume():
    """The resumed fit reported its last validation at its own count of loop steps (55 instead of 80): the callback
    emptied its restored rewards at on_train_start and counted them for the label."""
    module = SimpleNamespace(loop_step=0, last_metrics={})
    first = RunSummary()
    first.setup(None, module, "fit")
    _validate(first, module, 0.5, sanity=(2, 8))  # a sanity check over 2 of 8 batches: not a measurement
    _validate(first, module, 0.125, sanity=(8, 8))  # over all of them: the starting weights, loop step 0
    first.on_train_start(None, module)
    _steps(first, module, [0.1, 0.2, 0.3])
    _validate(first, module, 0.25)
    resumed, module = RunSummary(), SimpleNamespace(loop_step=3, last_metrics={})
    resumed.setup(None, module, "fit")
    resumed.load_state_dict(first.state_dict())  # Lightning restores callback state after setup
    resumed.on_train_start(None, module)
    _validate(resumed, module, 0.25, sanity=(8, 8))  # the same loop step measured again: counted once
    _steps(resumed, module, [0.4, 0.5])
    _validate(resumed, module, 0.75)
    report = resumed.report(SimpleNamespace(global_step=5, log_dir="runs/x", lightning_module=module))
    assert "loop steps       5  (2 in this fit, from loop step 3; optimizer steps: 5)" in report
    assert "reward first 5   0.300  (loop steps 1-5)" in report and "reward last 5    0.300  (loop steps 1-5" in report
    assert "val/reward first 0.125  (loop step 0)" in report
    assert "val/reward last  0.750  (loop step 5, +0.625; 3 validations)" in report


def test_a_resumed_fit_reports_loop_steps_of_the_whole_run(tiny_policy_dir, tmp_path, capsys):
    """A real resume: Lightning restores the summary's rows after setup, and the loop step comes from the checkpoint
    (before training puts the loop counters back)."""
    def fit(loop_steps: int, ckpt_path=None) -> str:
        saver = GRPOCheckpoint(dirpath=tmp_path / "ckpt", every_n_loop_steps=1)
        fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path, loop_steps, callbacks=[RunSummary(plot=False), saver],
                 ckpt_path=ckpt_path, val_size=4, val_check_interval=1, num_sanity_val_steps=-1)
        return capsys.readouterr().out

    fit(2)
    out = fit(3, ckpt_path=complete_checkpoints(tmp_path / "ckpt")[-1])
    assert "loop steps       3  (1 in this fit, from loop step 2; optimizer steps: 6)" in out
    assert re.search(r"reward first 3   \S+  \(loop steps 1-3\)", out)
    assert re.search(r"val/reward first \S+  \(loop step 0\)", out)
    # 0 and 1 restored, then 3 (the step-2 checkpoint is written before that step's validation, and Lightning runs
    # no sanity check on a resume)
    assert re.search(r"val/reward last  \S+  \(loop step 3, \S+; 3 validations\)", out), out


def test_a_dpo_run_reports_its_loop_steps_loss_accuracy_and_pairs():
    """A DPO run said `loop steps 0`, `reward first 5 nan` and `0 trained tokens/s`: it logs no reward/mean."""
    summary, module = RunSummary(window=2), SimpleNamespace(loop_step=0, last_metrics={})
    summary.setup(None, module, "fit")
    summary.on_train_start(None, module)
    for loss, acc in [(0.69, 0.0), (0.6, 0.5), (0.5, 0.75)]:  # dpo/accuracy: 0 at a tie
        module.loop_step += 1
        module.last_metrics = {"dpo/loss": loss, "dpo/accuracy": acc, "dpo/pairs": 8.0, "step": module.loop_step}
        summary.on_train_batch_end(None, module, None, None, 0)
    trainer = SimpleNamespace(sanity_checking=False, callback_metrics={"val/accuracy": 0.625})
    summary.on_validation_end(trainer, module)
    report = summary.report(SimpleNamespace(global_step=3, log_dir="runs/dpo", lightning_module=module))
    assert "loop steps       3  (optimizer steps: 3)" in report
    assert "dpo/loss first 2 0.645  (loop steps 1-2)" in report and "dpo/loss last 2  0.550  (loop steps 2-3" in report
    assert "dpo/accuracy" not in report  # one accuracy, the held-out one, as curves.png draws it
    assert "val/accuracy first 0.625  (loop step 3)" in report
    assert "trained pairs/s" in report and "nan" not in report and "reward" not in report


# -- every shipped config: summary, metrics.csv and curves.png agree ------------------------------------------------
CONFIGS = Path(__file__).parents[1] / "configs"
FAST = ["--trainer.val_check_interval=3", "--trainer.enable_progress_bar=false"]
"""Six loop steps (max_steps below) validated every 3: the 5-step first and last windows differ."""
SHRUNK = {
    "quickstart": ["--trainer.max_steps=6", "--model.policy.warm_start_steps=30", "--data.val_size=16",
                   "--model.rl.batch_per_replica=16", "--model.rl.micro_batch_per_replica=16", *FAST],
    "opd-arith": ["--trainer.max_steps=6", "--model.policy.warm_start_steps=10", "--data.val_size=8",
                  "--model.opd.teacher.warm_start_steps=20", "--model.rl.batch_per_replica=16",
                  "--model.rl.micro_batch_per_replica=8", *FAST],
    "dpo-arith": ["--trainer.max_steps=6", "--model.dpo.batch_size=8", "--model.dpo.grad_accum=2",
                  "--data.val_size=8", *FAST],
    "tools-quickstart": ["--trainer.max_steps=6", "--model.rl.batch_per_replica=16", "--model.rl.group_size=4",
                         "--model.rl.micro_batch_per_replica=16", "--model.policy.warm_start_steps=20",
                         "--data.val_size=8", "--model.env.max_turns=2", *FAST],
    "vlm-quickstart": ["--trainer.max_steps=6", "--model.policy.warm_start_steps=10", "--data.val_size=8",
                       "--model.rl.batch_per_replica=16", "--model.rl.micro_batch_per_replica=16", *FAST],
    # vLLM on CPU (slow): n_mini 2 for LoRA, as the config's own n_mini > 1
    "lora-quickstart": ["--trainer.max_steps=12", "--model.policy.warm_start_steps=30", "--data.val_size=8",
                        "--model.rl.batch_per_replica=16", "--model.rl.mini_batch_per_replica=8",
                        "--model.rl.micro_batch_per_replica=8", *FAST],
}
CHECKED_ON_THEIR_OWN_RUN = {
    "vllm-cpu": "test_quickstart.py::test_vllm_config_learns_the_quickstart_task (as shipped)",
    "async-quickstart": "test_quickstart.py::test_vllm_config_learns_the_quickstart_task (as shipped)",
    "vllm-server": "test_quickstart.py::test_vllm_config_learns_the_quickstart_task (as shipped)",
    "qwen2.5-0.5b-gsm8k": "test_recipes.py::test_gsm8k_recipe_as_shipped_on_a_tiny_model",
    "qwen2.5-vl-3b-geometry": "test_recipes.py (needs vLLM to load Qwen2.5-VL: torchvision, a GPU box)",
}
"""Configs whose own test already runs them: it calls ``check_agreement`` on that run (no second vLLM fit here)."""
VLLM = {"lora-quickstart"}
SHIPPED = sorted(p.stem for p in CONFIGS.glob("*.yaml") if p.name != "sweep.yaml" and
                 p.stem not in CHECKED_ON_THEIR_OWN_RUN)


def _param(name: str):
    marks = [pytest.mark.slow, pytest.mark.vllm] if name in VLLM else []
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", [_param(n) for n in SHIPPED])
def test_summary_csv_and_plot_agree_on_every_shipped_config(name, tmp_path, monkeypatch, capsys):
    """Each config's fit (model, data and sizes shrunk; precision and engine its own): the summary's first/last
    figures and validations are metrics.csv's, and the plot draws exactly those rows."""
    if name in VLLM:
        pytest.importorskip("vllm")
    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(CONFIGS / f"{name}.yaml"), *SHRUNK[name]])
    check_agreement(name, tmp_path / "runs" / name / "version_0", capsys.readouterr().out, tmp_path)


def test_every_shipped_config_is_covered():
    every = {p.stem for p in CONFIGS.glob("*.yaml") if p.name != "sweep.yaml"}
    assert every == set(SHRUNK) | set(CHECKED_ON_THEIR_OWN_RUN) and set(SHIPPED) == set(SHRUNK)
    assert importlib.util.find_spec("matplotlib") is not None  # the agreement test reads the plot's lines


def test_after_a_resume_the_summary_says_which_folder_holds_which_loop_steps():
    """Issue 47: after a resume the summary reported loop steps 1-6 while the new version folder's metrics.csv and
    curves.png hold 4-6 only. The logs line now names this folder's loop steps and the folders of the earlier ones."""
    module = SimpleNamespace(loop_step=0, last_metrics={})
    first = RunSummary()
    first.setup(None, module, "fit")
    first.on_train_start(SimpleNamespace(log_dir="runs/q/version_0"), module)
    _steps(first, module, [0.1, 0.2, 0.3])
    resumed = RunSummary()
    resumed.setup(None, module, "fit")
    resumed.load_state_dict(first.state_dict())
    resumed.on_train_start(SimpleNamespace(log_dir="runs/q/version_1"), module)
    _steps(resumed, module, [0.4, 0.5, 0.6])
    trainer = SimpleNamespace(global_step=6, log_dir="runs/q/version_1", lightning_module=module)
    assert "  logs             runs/q/version_1  (loop steps 4-6; loop steps 1-3: runs/q/version_0)" in \
        resumed.report(trainer).splitlines()
    again = RunSummary()  # a second resume: every earlier folder is named
    again.setup(None, module, "fit")
    again.load_state_dict(resumed.state_dict())
    again.on_train_start(SimpleNamespace(log_dir="runs/q/version_2"), module)
    _steps(again, module, [0.7])
    trainer = SimpleNamespace(global_step=7, log_dir="runs/q/version_2", lightning_module=module)
    assert ("  logs             runs/q/version_2  (loop steps 7-7; loop steps 1-3: runs/q/version_0; loop steps 4-6: "
            "runs/q/version_1)") in again.report(trainer).splitlines()
    assert "  logs             runs/q/version_0" in first.report(SimpleNamespace(
        global_step=3, log_dir="runs/q/version_0", lightning_module=module)).splitlines()  # one folder: as before


def test_a_real_resume_names_the_folder_of_the_earlier_loop_steps(tiny_policy_dir, tmp_path, capsys):
    from lightning.pytorch.loggers import CSVLogger

    def fit(loop_steps: int, ckpt_path=None) -> str:
        saver = GRPOCheckpoint(dirpath=tmp_path / "ckpt", every_n_loop_steps=1)
        fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path, loop_steps, callbacks=[RunSummary(plot=False), saver],
                 ckpt_path=ckpt_path, logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=1)
        return capsys.readouterr().out

    fit(2)
    out = fit(3, ckpt_path=complete_checkpoints(tmp_path / "ckpt")[-1])
    folder = tmp_path / "run" / "version_1"
    assert f"  logs             {folder}  (loop steps 3-3; loop steps 1-2: {tmp_path / 'run' / 'version_0'})" in out
    with open(folder / "metrics.csv") as f:  # what that folder's metrics.csv (and so its curves.png) holds
        assert [int(r["step"]) for r in csv.DictReader(f) if r.get("grpo/loss")] == [3]
