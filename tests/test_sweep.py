"""configs/sweep.yaml as a W&B agent would run it: two trials, offline, one after the other in one directory.

The command lines are built by wandb's own sweep helpers (``create_sweep_command``,
``create_sweep_command_args``: the exact ``--key=value`` strings the agent substitutes for
``${args}``) and expanded the way ``wandb.wandb_agent.Agent._command_run`` does. The only change to
the sweep's command: flags that shorten a trial to 2 loop steps, inserted before ``${args}``.
The W&B run files are read back with ``wandb_offline.read_run``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from wandb_offline import read_run

pytestmark = pytest.mark.heavy  # two sweep trials, each a fit: CI and `make test-integration`

ROOT = Path(__file__).parents[1]
SHORTEN = ["--trainer.limit_train_batches=2", "--trainer.val_check_interval=2", "--data.val_size=16",
           "--model.policy.warm_start_steps=30"]
"""2 loop steps, validated before (the config's full sanity check) and at the end on 16 held-out prompts; the warm
start of QUICKSTART_ARGS (cached)."""
TINY_TRIAL = ["--trainer.limit_train_batches=1", "--data.val_size=0", "--trainer.num_sanity_val_steps=0",
              "--model.policy.warm_start_steps=30"]
"""One loop step, no validation, the warm start of SHORTEN (cached): a trial's files in seconds."""


def agent_command(sweep: dict, params: dict, extra: list[str]) -> list[str]:
    """The argv the W&B agent runs for one trial of ``sweep`` with parameter values ``params``."""
    from wandb.sdk.launch.sweeps import utils as sweep_utils

    template = list(sweep["command"])
    template[template.index("${args}"):template.index("${args}")] = extra
    command = sweep_utils.create_sweep_command(template)
    variables = sweep_utils.create_sweep_command_args({"args": {k: {"value": v} for k, v in params.items()}})
    variables.update(interpreter=["python"], program=[sweep["program"]], env=["/usr/bin/env"])
    argv = []
    for chunk in map(str, command):  # as Agent._command_run: a ${macro} chunk expands to its list
        macro = chunk.startswith("${") and chunk.endswith("}")
        argv += (variables.get(chunk[2:-1]) or []) if macro else [chunk]
    return argv


def trial_env(tmp_path: Path) -> dict:
    """The environment a W&B agent gives a trial: offline, its run files under ``tmp_path``, the venv's
    ``lightning-grpo`` first on PATH. No inherited WANDB_* (an earlier in-process wandb run leaves WANDB_SERVICE set: a
    child would join that service and write its run elsewhere)."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    return {**inherited, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def run_trials(tmp_path: Path, sweep: dict, trials: list[dict], extra: list[str]) -> None:
    """Run ``trials`` one after another in ``tmp_path`` (holding configs/quickstart.yaml) as the agent would."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "quickstart.yaml").symlink_to(ROOT / "configs" / "quickstart.yaml")
    env = trial_env(tmp_path)
    for i, params in enumerate(trials):
        proc = subprocess.run(agent_command(sweep, params, extra), cwd=tmp_path, env={**env, "WANDB_RUN_ID": f"trial{i}"},
                              check=False, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]


def grid(sweep: dict) -> list[dict]:
    names = list(sweep["parameters"])
    return [dict(zip(names, values)) for values in itertools.product(*(sweep["parameters"][n]["values"] for n in names))]


def test_agent_command_is_the_sweep_command_with_dotted_flags():
    sweep = yaml.safe_load((ROOT / "configs" / "sweep.yaml").read_text())
    argv = agent_command(sweep, grid(sweep)[-1], [])
    assert argv[:6] == ["/usr/bin/env", "lightning-grpo", "fit", "--config", "configs/quickstart.yaml",
                        "--trainer.logger=WandbLogger"]
    assert argv[-3:] == ["--model.rl.mini_batch_per_replica=32", "--model.optim.lr=0.001", "--seed_everything=2"]


def test_two_sweep_trials_get_a_run_folder_each(tmp_path):
    """Issue 47: two trials of configs/sweep.yaml wrote into one runs/completions.jsonl (the second appended its loop
    steps after the first's) and the second replaced config.yaml. Each trial now has a version folder of its own
    holding its own config, completions and W&B files. Trials shortened to one loop step of the quickstart."""
    sweep = yaml.safe_load((ROOT / "configs" / "sweep.yaml").read_text())
    first, last = grid(sweep)[0], grid(sweep)[-1]
    run_trials(tmp_path, sweep, [first, last], TINY_TRIAL)
    folders = sorted((tmp_path / "runs" / "quickstart").glob("version_*"))
    assert [f.name for f in folders] == ["version_0", "version_1"]
    for i, (folder, params) in enumerate(zip(folders, (first, last))):
        config = yaml.safe_load((folder / "config.yaml").read_text())
        assert config["seed_everything"] == params["seed_everything"]  # this trial's config, not the other's
        rows = [json.loads(line) for line in (folder / "completions.jsonl").read_text().splitlines()]
        assert rows and {r["step"] for r in rows} == {1}  # one run: one loop step, written once
        assert [p.name for p in folder.rglob("run-*.wandb")] == [f"run-trial{i}.wandb"]
    assert not (tmp_path / "runs" / "completions.jsonl").exists() and not (tmp_path / "runs" / "config.yaml").exists()


@pytest.mark.slow
def test_two_sweep_trials_run_offline_in_one_directory(tmp_path):
    sweep = yaml.safe_load((ROOT / "configs" / "sweep.yaml").read_text())
    first, last = grid(sweep)[0], grid(sweep)[-1]
    run_trials(tmp_path, sweep, [first, last], SHORTEN)
    runs = {run_id: read_run(next(tmp_path.rglob(f"run-{run_id}.wandb"))) for run_id in ("trial0", "trial1")}
    a, b = runs["trial0"], runs["trial1"]
    for key in ("model.rl.mini_batch_per_replica", "model.optim.lr", "seed_everything"):
        assert (a.config[key], b.config[key]) == (first[key], last[key])  # logged params differ as swept
    assert (a.config["model.seed"], b.config["model.seed"]) == (0, 2)  # the seed each trial ran with
    assert a.config["model.rl.batch_per_replica"] == b.config["model.rl.batch_per_replica"] == 64
    # x-axis: the loop step (Lightning's WandbLogger calls it trainer/global_step); global_step = optimizer steps
    train = [h for h in b.history if "reward/mean" in h]
    assert [h["trainer/global_step"] for h in train] == [h["loop_step"] for h in train] == [1, 2]
    assert [h["global_step"] for h in train] == [2, 4]  # mini-batch 32 of 64: n_mini = 2
    # the starting policy (the config's full sanity check, loop step 0) and the end of the 2 loop steps
    assert [h["trainer/global_step"] for h in b.history if "val/reward" in h] == [0, 2]
