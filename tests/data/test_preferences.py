"""Preference pairs: TRL's preference format (plain and chat), tokenizing, clear errors, and the data module's
deterministic shards and resume."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_grpo.data.preference_module import PreferenceDataModule
from lightning_grpo.data.preferences import PreferenceDataError, PreferencePair, builtin_pairs, encode_pairs, load_pairs
from lightning_grpo.tiny.tokenizer import make_char_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plain_jsonl_in_trl_format(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "3+4=", "chosen": "7", "rejected": "8", "source": "x"},
                                              {"prompt": "1+1=", "chosen": "2", "rejected": "11"}])
    pairs = load_pairs(str(path))
    assert pairs == [PreferencePair(0, "3+4=", "7", "8"), PreferencePair(1, "1+1=", "2", "11")]


def test_missing_chosen_or_rejected_names_the_columns_present(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "3+4=", "good": "7", "bad": "8"}])
    with pytest.raises(PreferenceDataError, match=r"no column 'chosen' or 'rejected'; the row has columns "
                                                  r"\['bad', 'good', 'question'\]"):
        load_pairs(str(path))
    pairs = load_pairs(str(path), prompt_key="question", chosen_key="good", rejected_key="bad")
    assert pairs[0] == PreferencePair(0, "3+4=", "7", "8")


def test_missing_prompt_names_the_columns_present():
    with pytest.raises(PreferenceDataError, match=r"no column 'prompt'; the row has columns \['chosen', 'rejected'\]"):
        load_pairs([{"chosen": "7", "rejected": "8"}])


def test_conversational_pairs_with_and_without_a_prompt_column():
    user = [{"role": "user", "content": "3+4="}]
    explicit = load_pairs([{"prompt": user, "chosen": [{"role": "assistant", "content": "7"}],
                            "rejected": [{"role": "assistant", "content": "8"}]}])
    implicit = load_pairs([{"chosen": user + [{"role": "assistant", "content": "7"}],
                            "rejected": user + [{"role": "assistant", "content": "8"}]}])
    assert explicit == implicit  # TRL's implicit prompt: the messages both answers share


def test_chat_pairs_go_through_the_chat_template():
    tok = make_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    pair = PreferencePair(0, [{"role": "user", "content": "3+4="}], [{"role": "assistant", "content": "7"}],
                          [{"role": "assistant", "content": "8"}])
    batch = encode_pairs([pair], tok)
    ids = batch.chosen_ids[0, batch.chosen_attention[0]].tolist()
    assert tok.decode(ids[: -1]) == "u:3+4=\na:7\n" and ids[-1] == tok.eos_token_id
    answer = batch.chosen_ids[0, batch.chosen_mask[0]].tolist()
    assert tok.decode(answer[:-1]) == "7\n"  # the loss counts the answer turn and EOS only
    plain = make_char_tokenizer()  # no chat template: refused with the fix
    with pytest.raises(PreferenceDataError, match="need a tokenizer with a chat template"):
        encode_pairs([pair], plain)


def test_encoding_masks_the_answer_and_eos_and_cuts_at_max_length():
    tok = make_char_tokenizer()
    batch = encode_pairs([PreferencePair(0, "3+4=", "7", "8"), PreferencePair(1, "1+1=", "2", "123")], tok)
    assert batch.chosen_mask.sum(-1).tolist() == [2, 2] and batch.rejected_mask.sum(-1).tolist() == [2, 4]
    assert batch.rejected_ids[1, 4:8].tolist() == tok("123", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert not (batch.chosen_mask & ~batch.chosen_attention).any()
    cut = encode_pairs([PreferencePair(1, "1+1=", "2", "123")], tok, max_length=6)
    assert cut.rejected_attention.sum().item() == 6 and cut.rejected_mask.sum().item() == 2
    with pytest.raises(PreferenceDataError, match="prompt has 4 tokens, not fewer than max_length=4"):
        encode_pairs([PreferencePair(1, "1+1=", "2", "3")], tok, max_length=4)


def test_select_trims_each_side_and_sequences_stacks_them():
    tok = make_char_tokenizer()
    batch = encode_pairs([PreferencePair(0, "3+4=", "7", "8"), PreferencePair(1, "1+1=", "2", "12345")], tok)
    first = batch.select(slice(0, 1))
    assert first.rejected_ids.shape[1] == 6 and batch.rejected_ids.shape[1] == 10
    ids, attention, mask = batch.sequences()
    assert ids.shape == (4, 10) and torch.equal(ids[2:], batch.rejected_ids) and not attention[0, 6:].any()


def test_a_datasets_dataset_is_read_as_rows():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": "3+4=", "chosen": "7", "rejected": "8"}])
    assert load_pairs(ds) == [PreferencePair(0, "3+4=", "7", "8")]


def test_builtin_pairs_keep_held_out_pairs_out_of_training():
    train, val = builtin_pairs("arith_small", "train", 2000, 0), builtin_pairs("arith_small", "val", 64, 0)
    assert all(p.chosen == str(eval(p.prompt[:-1])) and p.rejected != p.chosen for p in train + val)
    assert not {(p.prompt, p.rejected) for p in train} & {(p.prompt, p.rejected) for p in val}
    assert len({(p.prompt, p.rejected) for p in val}) == len(val)


def test_data_module_shards_each_step_and_resumes(tmp_path):
    rows = [{"prompt": f"{i}+0=", "chosen": str(i), "rejected": str(i + 1)} for i in range(10)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    ranks = [PreferenceDataModule(str(path), pairs_per_step=4, val_size=0) for _ in range(2)]
    for r, dm in enumerate(ranks):
        dm.rank, dm.world_size = r, 2
    steps = [[dm.pairs_at(s) for dm in ranks] for s in range(3)]
    for s, (a, b) in enumerate(steps):
        assert [p.id for p in a + b] == list(range(4 * s, 4 * s + 4))  # rank 0 then rank 1, ids = stream positions
    assert len({p.prompt for s in steps[:2] for share in s for p in share}) == 8  # within an epoch: no repeats
    dm = ranks[0]
    dm.mark_consumed(steps[1][0])
    resumed = PreferenceDataModule(str(path), pairs_per_step=4, val_size=0)
    resumed.load_state_dict(dm.state_dict())
    assert resumed.position == 2 and next(iter(resumed.train_dataloader()))[0].id == 8
