"""Prompt sources through ``datasets``: files, folders, Hub ids from the local cache (offline), chat rows, columns."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from helpers import cache_hub_dataset

from lightning_grpo.data.prompts import PromptDataModule
from lightning_grpo.data.sources import PromptDataError, load_items

GSM8K = "tests/data/gsm8k_tiny.jsonl"
ROWS = [json.loads(line) for line in Path(GSM8K).read_text().splitlines()]


@pytest.fixture(scope="module")
def gsm8k_cached():
    """openai/gsm8k 'main' in the (test-session) datasets cache, as a download leaves it: train and test splits."""
    target = cache_hub_dataset(datasets.config.HF_DATASETS_CACHE, "openai/gsm8k", "main",
                               {"train": GSM8K, "test": GSM8K})
    yield "openai/gsm8k"
    import shutil

    shutil.rmtree(target.parent)


def questions(items):
    return [it.text for it in items]


@pytest.mark.parametrize("suffix", ["json", "parquet", "csv"])
def test_files_read_through_datasets(tmp_path, suffix):
    ds = datasets.Dataset.from_list(ROWS)
    path = tmp_path / f"gsm8k.{suffix}"
    getattr(ds, f"to_{suffix}")(str(path), **({"lines": False} if suffix == "json" else {}))
    items = load_items(str(path), prompt_key="question")
    assert questions(items) == [r["question"] for r in ROWS]
    assert items[0].answer == ROWS[0]["answer"] and items[0].meta == {"answer": ROWS[0]["answer"]}


def test_save_to_disk_folders(tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": ds.select(range(5)), "test": ds.select(range(5, 8))}).save_to_disk(
        str(tmp_path / "dict"))
    assert len(load_items(str(tmp_path / "one"), prompt_key="question")) == 8
    assert len(load_items(str(tmp_path / "dict"), prompt_key="question", dataset_split="test")) == 3
    with pytest.raises(PromptDataError, match=r"data.split='validation': .*dict has the splits \['test', 'train'\]"):
        load_items(str(tmp_path / "dict"), prompt_key="question", dataset_split="validation")


def test_a_dataset_id_loads_offline_from_the_local_cache(gsm8k_cached):
    items = load_items(gsm8k_cached, subset="main", dataset_split="train", prompt_key="question",
                       prompt_template="gsm8k")
    assert questions(items)[0].startswith(ROWS[0]["question"]) and "####" in items[0].text
    assert len(load_items(gsm8k_cached, subset="main", dataset_split="test", prompt_key="question")) == 8
    with pytest.raises(PromptDataError, match=r"data.split='validation' of data.source='openai/gsm8k'.*Unknown split"):
        load_items(gsm8k_cached, subset="main", dataset_split="validation", prompt_key="question")
    with pytest.raises(PromptDataError, match=r"data.subset='socratic' of data.source='openai/gsm8k'"):
        load_items(gsm8k_cached, subset="socratic", prompt_key="question")


def test_a_dataset_id_not_in_the_cache_names_the_id_and_the_fix():
    with pytest.raises(PromptDataError) as e:
        load_items("someone/not-cached", prompt_key="question")
    first = str(e.value).splitlines()[0]
    assert first.startswith("data.source='someone/not-cached': not a local file or folder, and the datasets id is "
                            "not in the local datasets cache")
    assert "HF_HUB_OFFLINE=1" in first and "datasets.load_dataset('someone/not-cached')" in first


def test_a_column_that_does_not_exist_names_it_and_the_columns(gsm8k_cached):
    with pytest.raises(PromptDataError) as e:
        load_items(gsm8k_cached, subset="main", prompt_key="problem")
    assert str(e.value).splitlines()[0] == (
        "data.prompt_key='problem': 'openai/gsm8k' has no such column (its columns: ['question', 'answer']). "
        "Set --data.prompt_key to the column holding the prompt (text or chat messages)")
    with pytest.raises(PromptDataError, match=r"data.answer_key='solution': .* has no such column"):
        load_items(gsm8k_cached, subset="main", prompt_key="question", answer_key="solution")


def test_chat_rows_system_prompt_and_chat_wrapping(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1), "level": i} for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = load_items(str(path), system_prompt="Answer with a number.")
    assert items[0].messages == [{"role": "system", "content": "Answer with a number."},
                                 {"role": "user", "content": "0+1="}]
    assert items[2].text == "2+1=" and items[2].meta == {"answer": "3", "level": 2}  # extra columns travel
    plain = load_items(GSM8K, prompt_key="question", chat=True, prompt_template="Q: {prompt}")
    assert plain[0].messages == [{"role": "user", "content": "Q: " + ROWS[0]["question"]}]
    prefixed = load_items(GSM8K, prompt_key="question", system_prompt="Be brief.")
    assert prefixed[0].messages is None and prefixed[0].text == "Be brief.\n" + ROWS[0]["question"]
    path.write_text(json.dumps({"prompt": [{"content": "no role"}], "answer": "1"}) + "\n")
    with pytest.raises(PromptDataError, match=r"chat.jsonl:1: 'prompt' must be a non-empty string or a list of chat"):
        load_items(str(path))


def test_val_size_holds_rows_out_of_a_file_source():
    """A file/dataset source with val_size gets held-out prompts (main skipped validation silently)."""
    dm = PromptDataModule(GSM8K, prompts_per_step=2, prompt_key="question", val_size=3, shuffle=False)
    dm.setup("fit")
    held = {r.text for batch in dm.val_batches() for r in batch}
    trained = {dm.records(step)[i].text for step in range(10) for i in range(2)}
    assert len(held) == 3 and len(trained) == 5 and not held & trained
    other_seed = PromptDataModule(GSM8K, prompts_per_step=2, prompt_key="question", val_size=3, seed=7)
    other_seed.setup("fit")
    assert {r.text for b in other_seed.val_batches() for r in b} == held  # the same held-out set for every seed
    with pytest.raises(PromptDataError, match=r"data.val_size=8: would hold out all 8 prompts"):
        PromptDataModule(GSM8K, prompts_per_step=2, prompt_key="question", val_size=8).setup("fit")


def test_val_split_of_a_dataset_id(gsm8k_cached):
    dm = PromptDataModule(gsm8k_cached, subset="main", prompts_per_step=4, prompt_key="question", val_split="test",
                          val_size=4)
    dm.setup("fit")
    assert [len(b) for b in dm.val_batches()] == [4]
    assert len(dm._stream.items) == 8  # the train split is trained on whole: validation comes from test
