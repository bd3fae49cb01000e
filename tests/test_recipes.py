"""Every config in configs/ parses, and the GSM8K recipe's loading path runs on a tiny model."""

from pathlib import Path

import pytest
import yaml

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
    assert printed["model.rl.batch_per_replica"] % printed["model.rl.group_size"] == 0


@pytest.mark.slow
def test_gsm8k_recipe_path_on_tiny_model(tmp_path, monkeypatch):
    """The real-model recipe, with only the model, data file, sizes and device swapped for tiny CPU ones."""
    monkeypatch.chdir(tmp_path)
    recipe = Path(__file__).parent.parent / "configs" / "qwen2.5-0.5b-gsm8k.yaml"
    data = Path(__file__).parent / "data" / "gsm8k_tiny.jsonl"
    main(["fit", "--config", str(recipe), "--model.policy.path=tiny:gsm8k", "--model.policy.dtype=float32",
          f"--data.source={data}", "--data.val_size=0", "--trainer.accelerator=cpu", "--trainer.precision=32-true",
          "--trainer.max_steps=4", "--model.rl.batch_per_replica=8", "--model.rl.group_size=4",
          "--model.rl.mini_batch_per_replica=4", "--model.rl.micro_batch_per_replica=2", "--model.rollout.engine=hf",
          "--model.rollout.max_new_tokens=8", "--trainer.callbacks=[]", "--checkpoint.every_n_loop_steps=1"])
    runs = list((tmp_path / "runs" / "qwen2.5-0.5b-gsm8k").glob("version_*/metrics.csv"))
    assert runs, "no metrics written"
    text = runs[0].read_text()
    assert "reward/math_answer" in text and "grpo/clip_frac" in text
