"""The quickstarts learn: `lightning-grpo fit --config configs/quickstart.yaml`, as `make run` runs it, and every
quickstart that learns on CPU over seeds 0, 1, 2 on held-out data (one fit per config and seed: tests/shipped_fits.py)."""

import csv
import re
from pathlib import Path

import pytest
import torch
from agreement import check_agreement
from shipped_fits import LEARNERS, MAY_STALL, RISE, SEEDS, learned, shares_fit

from lightning_grpo.cli import main


@pytest.mark.slow
@shares_fit("quickstart")
def test_quickstart_reward_rises_and_writes_metrics_and_checkpoint(tmp_path_factory):
    fit = learned("quickstart", 0, tmp_path_factory)  # as `make run` runs it (seed 0 is the file's)
    run, every = fit.run, fit.rows
    val = [float(r["val/reward"]) for r in every if r.get("val/reward")]
    assert len(val) == 9 and val[0] > 0, val  # held-out prompts the policy can get right (main: 0.0 throughout)
    # The first val/reward is the starting policy's (num_sanity_val_steps: -1), a row at loop step 0 and the
    # summary's first: the rise over the run.
    start = float(re.search(r"val/reward first (\d\.\d{3})  \(loop step 0\)", fit.out).group(1))
    assert abs(start - val[0]) < 6e-4 and "; 9 validations)" in fit.out
    assert val[-1] > start + 0.05, f"val/reward did not rise: {start} before training, then {val}"
    rows = [r for r in every if r.get("reward/mean")]
    rewards = [float(r["reward/mean"]) for r in rows]
    assert len(rewards) == 80
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, f"reward did not rise: first 5 {first:.3f}, last 5 {last:.3f}"
    for column in ("grpo/loss", "grpo/denom", "completion/len_mean", "reward/frac_zero_std"):
        assert all(r[column] != "" for r in rows), column
    assert list(run.glob("checkpoints/*.ckpt")), "no checkpoint written"


@pytest.mark.slow
@shares_fit("vlm-quickstart")
def test_vlm_quickstart_reward_rises(tmp_path_factory):
    """`lightning-grpo fit --config configs/vlm-quickstart.yaml` as shipped: a tiny Qwen2.5-VL learns which colour
    the square in the image is (only the pixels tell)."""
    fit = learned("vlm-quickstart", 0, tmp_path_factory)
    run, every = fit.run, fit.rows
    rows = [r for r in every if r.get("reward/mean")]
    rewards = [float(r["reward/mean"]) for r in rows]
    assert len(rewards) == 40
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, f"reward did not rise: first 5 {first:.3f}, last 5 {last:.3f}"
    assert all(r["data/bad_records_skipped"] == "0.0" for r in rows)
    assert list(run.glob("checkpoints/*.ckpt")), "no checkpoint written"


VLLM_CONFIGS = {"vllm-cpu": "engine: vllm\n", "vllm-server": "engine: vllm_server\n",
                "async-quickstart": "max_off_policy_steps: 1\n"}
"""Config -> a line its printed config.yaml holds: in-process vLLM; a `vllm serve` child, in turns or one batch ahead."""
IN_TURNS = pytest.mark.xdist_group("shipped-vllm-in-turns")
"""vllm-cpu and vllm-server: compared with each other below, so one pytest-xdist worker runs both (once each)."""
VLLM_NAMES = [pytest.param(name, marks=IN_TURNS if name != "async-quickstart" else ()) for name in sorted(VLLM_CONFIGS)]
_RUNS: dict[str, tuple[Path, str]] = {}


def shipped_run(name: str, tmp_path_factory, monkeypatch, capsys) -> tuple[Path, str]:
    """`lightning-grpo fit --config configs/<name>.yaml` as shipped, once per session: (run folder, printed output)."""
    if name not in _RUNS:
        folder, config = tmp_path_factory.mktemp(name), Path(__file__).parents[1] / "configs" / f"{name}.yaml"
        monkeypatch.chdir(folder)
        threads = torch.get_num_threads()
        if "engine: vllm_server" in config.read_text():  # its launch line on 2 cores: OMP_NUM_THREADS=1 (1.6x faster)
            torch.set_num_threads(1)
        try:
            main(["fit", "--config", str(config)])
        finally:
            torch.set_num_threads(threads)
        _RUNS[name] = (folder / "runs" / name / "version_0", capsys.readouterr().out)
    return _RUNS[name]


def rows_of(run: Path) -> list[dict]:
    return [r for r in csv.DictReader((run / "metrics.csv").open())]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("name", VLLM_NAMES)
def test_vllm_config_learns_the_quickstart_task(name, tmp_path, tmp_path_factory, monkeypatch, capsys):
    """`lightning-grpo fit --config configs/<name>.yaml` as shipped (nothing overridden: the tiny policy, the built-in
    task and the CPU are all here): the quickstart task, rolled out by vLLM (in-process, a server in turns with the
    update, or a server sampling one loop step ahead), learns."""
    pytest.importorskip("vllm")
    run, out = shipped_run(name, tmp_path_factory, monkeypatch, capsys)
    config = (run / "config.yaml").read_text()
    assert VLLM_CONFIGS[name] in config and "source: builtin:arith_small" in config
    every = rows_of(run)
    rewards = [float(r["reward/mean"]) for r in every if r.get("reward/mean")]
    assert len(rewards) == 80
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, f"reward did not rise: first 5 {first:.3f}, last 5 {last:.3f}"
    check_agreement(name, run, out, tmp_path)  # summary == metrics.csv == curves.png (tests/agreement.py)
    start = float(re.search(r"val/reward first (\d\.\d{3})  \(loop step 0\)", out).group(1))
    val = [float(r["val/reward"]) for r in every if r.get("val/reward")]
    assert val[-1] > start + 0.05, f"val/reward did not rise: {start} before training, then {val}"
    assert list(run.glob("checkpoints/*.ckpt")), "no checkpoint written"
    if name == "async-quickstart":  # the first batch is drawn on the spot, every later one a loop step stale
        stale = [float(r["rollout/staleness"]) for r in every if r.get("rollout/staleness")]
        assert stale == [0.0] + [1.0] * 79


@pytest.mark.slow
@pytest.mark.vllm
@IN_TURNS
def test_the_server_engine_in_turns_reproduces_the_in_process_engine(tmp_path_factory, monkeypatch, capsys):
    """configs/vllm-server.yaml is configs/vllm-cpu.yaml on a `vllm serve` child (max_off_policy_steps 0): the same
    seeds, weights and float32 sampler give the same completions, so every loop step's metrics agree. Measured: every
    reward/mean equal, grpo/loss within 1.1e-7 (80 loop steps)."""
    pytest.importorskip("vllm")
    ours, theirs = (rows_of(shipped_run(n, tmp_path_factory, monkeypatch, capsys)[0]) for n in ("vllm-server",
                                                                                                 "vllm-cpu"))
    steps = lambda rows, k: {r["step"]: float(r[k]) for r in rows if r.get(k)}
    assert steps(ours, "reward/mean") == steps(theirs, "reward/mean") and len(steps(ours, "reward/mean")) == 80
    assert steps(ours, "val/reward") == steps(theirs, "val/reward")
    loss, other = steps(ours, "grpo/loss"), steps(theirs, "grpo/loss")
    assert max(abs(loss[s] - other[s]) for s in loss) < 1e-6


TOOLS_CONFIG = Path(__file__).parents[1] / "configs" / "tools-quickstart.yaml"
_TOOLS_RUNS: dict[int, list[dict]] = {}


@pytest.fixture(scope="module")
def tools_run(tmp_path_factory):
    """`lightning-grpo fit --config configs/tools-quickstart.yaml --seed_everything=SEED` as shipped, one fit per seed
    for the module: SEED -> its metrics.csv rows."""

    def run(seed: int) -> list[dict]:
        if seed not in _TOOLS_RUNS:
            folder = tmp_path_factory.mktemp(f"tools-quickstart-{seed}")
            with pytest.MonkeyPatch.context() as patch:
                patch.chdir(folder)
                main(["fit", "--config", str(TOOLS_CONFIG), f"--seed_everything={seed}"])
            _TOOLS_RUNS[seed] = rows_of(folder / "runs" / "tools-quickstart" / "version_0")
        return _TOOLS_RUNS[seed]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tools_quickstart_learns_to_use_the_tool_on_held_out_prompts(tools_run, seed):
    """As shipped, 3 seeds: before training the greedy policy submits a guess without calling add (no reward: the
    answer needs the tool's result); after 8 loop steps it adds first and submits the result, on held-out prompts."""
    val = [r for r in tools_run(seed) if r.get("val/reward")]  # greedy episodes before training and after the last step
    assert [int(r["step"]) for r in val] == [0, 8]
    first, last = (float(val[i]["val/reward"]) for i in (0, -1))
    calls = [float(r["val/tools/call_frequency"]) for r in val]
    assert first <= 0.1 and calls[0] < 1.2, f"seed {seed}: the untrained policy already uses the tool: {first}, {calls}"
    assert last >= first + 0.25, f"val/reward did not rise (seed {seed}): {[r['val/reward'] for r in val]}"
    assert calls[-1] > 1.8, f"seed {seed}: val/tools/call_frequency {calls}"


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tools_quickstart_sampled_tool_use_rises(tools_run, seed):
    """The same runs: the sampled episodes add before submitting more often, first 4 vs last 4 loop steps; the tool
    and episode metrics are logged every loop step. (Their reward is not compared: 4 prompts a loop step make it
    too noisy over a few steps; measured at 10 loop steps, seed 0: 0.269 in both halves while held-out val/reward
    went 0.0 -> 0.5.)"""
    rows = [r for r in tools_run(seed) if r.get("reward/mean")]
    assert len(rows) == 8
    calls = [float(r["tools/call_frequency"]) for r in rows]
    first, last = sum(calls[:4]) / 4, sum(calls[-4:]) / 4
    assert last > first + 0.1, f"tools/call_frequency did not rise (seed {seed}): first 4 {first:.3f}, last 4 {last:.3f}"
    for metric in ("tools/failure_frequency", "episode/turns_mean", "episode/truncated_frac"):
        assert all(r[metric] != "" for r in rows), metric


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", [pytest.param(name, marks=shares_fit(name)) for name in sorted(LEARNERS)])
def test_held_out_validation_rises_as_shipped(name, seed, tmp_path_factory):
    """Every quickstart that learns on CPU, as shipped (overridden: the shipped policy at every seed, dpo-arith's
    length; shipped_fits.LEARNERS), over 3 seeds: its held-out validation at the end is RISE above the starting policy's
    (loop step 0). async-quickstart: tests/test_async_learning.py."""
    if name == "lora-quickstart":
        pytest.importorskip("vllm")
    fit = learned(name, seed, tmp_path_factory)
    val = fit.series(LEARNERS[name][1])
    print(f"{name} seed {seed}: {LEARNERS[name][1]} {val} ({fit.seconds:.0f} s, {fit.cpu_seconds:.0f} s CPU)")
    assert val[0][0] == 0, val  # the starting policy, measured
    if name in MAY_STALL:  # how many seeds must rise: the test below
        assert val[-1][1] >= val[0][1], f"{name} seed {seed}: held-out validation fell: {val}"
        return
    assert val[-1][1] > val[0][1] + RISE, f"{name} seed {seed}: held-out validation did not rise: {val}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(name, marks=shares_fit(name)) for name in sorted(MAY_STALL)])
def test_held_out_validation_rises_at_most_seeds(name, tmp_path_factory):
    """A config in MAY_STALL: at most MAY_STALL[name] of the 3 seeds' fits end at their start; the rest rise by RISE."""
    ends = []
    for seed in SEEDS:
        val = learned(name, seed, tmp_path_factory).series(LEARNERS[name][1])
        ends.append((seed, val[0][1], val[-1][1]))
    risen = [seed for seed, start, end in ends if end > start + RISE]
    assert len(risen) >= len(SEEDS) - MAY_STALL[name], f"{name}: (seed, start, end) {ends}"
