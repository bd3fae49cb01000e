"""``trainer.num_nodes`` / ``trainer.devices`` against what torchrun or ``srun`` started (``launcher.py``)."""

import pytest

from lightning_grpo.cli import main
from lightning_grpo.launcher import LaunchedWorld, check_launch, launched_world

TORCHRUN_2x1 = {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "RANK": "0"}
SRUN_2x1 = {"SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NAME": "grpo"}
SRUN_2x4 = {"SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NAME": "grpo"}


@pytest.mark.parametrize(("env", "world"), [
    (TORCHRUN_2x1, LaunchedWorld("torchrun", 2, 1)),
    ({**TORCHRUN_2x1, "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, LaunchedWorld("torchrun", 2, 4)),
    (SRUN_2x1, LaunchedWorld("srun", 2, 1)),
    (SRUN_2x4, LaunchedWorld("srun", 2, 4)),  # no SLURM_NTASKS_PER_NODE: tasks / nodes
    ({**SRUN_2x1, "SLURM_JOB_NAME": "bash"}, None),  # an interactive allocation: Lightning launches itself
    ({}, None),
])
def test_the_launchers_world_is_read_from_its_environment(env, world):
    assert launched_world(env) == world


@pytest.mark.parametrize(("nodes", "devices", "env", "says"), [
    (1, 1, TORCHRUN_2x1, "torchrun started 2 node(s) x 1 rank(s)"),
    (2, 2, TORCHRUN_2x1, "Set --trainer.num_nodes=2 --trainer.devices=1"),
    (1, "1", SRUN_2x1, "srun started 2 node(s) x 1 rank(s) (--nodes / --ntasks-per-node)"),
    (2, 1, SRUN_2x4, "Set --trainer.num_nodes=2 --trainer.devices=4"),
])
def test_a_topology_the_launcher_did_not_start_is_refused_naming_the_flags(nodes, devices, env, says):
    problems = check_launch(nodes, devices, env)
    assert len(problems) == 1 and says in problems[0]
    assert problems[0].startswith(f"trainer.num_nodes={nodes} x trainer.devices={devices}: ")


@pytest.mark.parametrize(("nodes", "devices", "env"), [
    (2, 1, TORCHRUN_2x1), (2, "auto", TORCHRUN_2x1), (2, 1, SRUN_2x1), (2, 4, SRUN_2x4), (1, 1, {}), (3, 2, {}),
])
def test_a_matching_topology_or_no_launcher_passes(nodes, devices, env):
    assert check_launch(nodes, devices, env) == []


def test_the_cli_refuses_it_before_the_trainer_is_built(monkeypatch, capsys, tiny_policy_dir):
    for key, value in TORCHRUN_2x1.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--model.policy.path", str(tiny_policy_dir), "--trainer.num_nodes=1", "--trainer.devices=1"])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert "trainer.num_nodes=1 x trainer.devices=1: torchrun started 2 node(s)" in err
    assert len(err.splitlines()) <= 3
