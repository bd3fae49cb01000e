import json
from itertools import chain

import pytest
import torch
from helpers import png
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_grpo.checks import ConfigError
from lightning_grpo.data.fitting import PromptFit, fit_prompts
from lightning_grpo.data.items import TaskItem
from lightning_grpo.data.prompts import PromptDataModule, PromptRecord, PromptStream
from lightning_grpo.data.sources import PromptDataError, load_items

GSM8K = "tests/data/gsm8k_tiny.jsonl"


def make_dm(rank=0, world=1, **kw):
    kw.setdefault("prompts_per_step", 4)
    kw.setdefault("builtin_size", 500)
    dm = PromptDataModule("builtin:arith", **kw)
    dm.rank, dm.world_size = rank, world
    dm.setup("fit")
    return dm


def take(dm, steps):
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(steps)]


def test_ids_are_stream_positions():
    batches = take(make_dm(), 3)
    assert [[r.id for r in b] for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert all(isinstance(r, PromptRecord) and r.answer == str(eval(r.text[:-1])) for b in batches for r in b)


def test_two_datamodules_give_identical_streams():
    assert take(make_dm(), 5) == take(make_dm(), 5)
    assert take(make_dm(), 2) != take(make_dm(seed=1), 2)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_are_disjoint_and_union_is_the_one_rank_stream(world):
    single = take(make_dm(prompts_per_step=8), 4)
    shards = [take(make_dm(rank=r, world=world, prompts_per_step=8), 4) for r in range(world)]
    for step in range(4):
        ids = [[r.id for r in shard[step]] for shard in shards]
        assert all(len(i) == 8 // world for i in ids)
        assert list(chain(*ids)) == [r.id for r in single[step]]  # rank order = stream order: contiguous, disjoint
        assert list(chain(*(shard[step] for shard in shards))) == single[step]
        assert ids[0] == [step * 8 + i for i in range(8 // world)]  # id = step * P + rank * P/W + i


def test_epochs_reshuffle_deterministically():
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    stream, again = PromptStream(load_items(rows), seed=3), PromptStream(load_items(rows), seed=3)
    epochs = [[stream.record(e * 5 + s).meta["source_index"] for s in range(5)] for e in range(3)]
    assert all(sorted(e) == list(range(5)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1
    assert [again.record(p) for p in range(15)] == [stream.record(p) for p in range(15)]
    assert [r.meta["source_index"] for r in PromptStream(load_items(rows), shuffle=False).step(2, 4)] == [3, 4, 0, 1]


def test_state_dict_resume_continues_the_stream():
    uninterrupted = take(make_dm(), 6)
    first = make_dm()
    for batch in take(first, 3):
        first.mark_consumed(batch)
    resumed = make_dm()
    resumed.load_state_dict(first.state_dict())
    assert take(resumed, 3) == uninterrupted[3:]


def test_resume_with_other_prompts_per_step_is_refused():
    dm = make_dm()
    with pytest.raises(ValueError, match="prompts_per_step=4.*checkpoint used 8"):
        dm.load_state_dict({"position": 2, "prompts_per_step": 8})


class Recorder(LightningModule):
    """Records the prompt ids each training step receives; a ``PromptConsumer`` (data/seam.py) of 4 prompts a step."""

    prompts_per_step = 4

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append([r.id for r in batch])
        return (self.weight * 0).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path, max_steps, ckpt_path=None, callbacks=()):
    model, dm = Recorder(), PromptDataModule("builtin:arith", val_size=0)
    trainer = Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        default_root_dir=tmp_path,
    )
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model, dm


def test_trainer_checkpoint_resumes_with_the_next_prompts(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    full, dm = fit(tmp_path, 5, callbacks=[ckpt])
    assert full.seen == [[4 * s + i for i in range(4)] for s in range(5)]
    assert dm.position == 5 and dm.prompts_per_step == 4  # prompts_per_step read from the module's rl
    resumed, _ = fit(tmp_path, 5, ckpt_path=str(tmp_path / "step=2.ckpt"))
    assert resumed.seen == full.seen[2:]


def test_jsonl_missing_key_names_file_line_key_and_fix(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"question": "1+1=", "answer": "2"}\n\n{"q": "2+2=", "answer": "4"}\n')
    with pytest.raises(PromptDataError, match=rf"{path}:3: no key 'question' \(the row has \['answer', 'q'\]\)") as e:
        load_items(str(path), prompt_key="question")
    assert "--data.prompt_key" in str(e.value)
    with pytest.raises(PromptDataError, match=r"data.answer_key='solution': '.*p.jsonl' has no such column \(its "
                                              r"columns: \['question', 'answer', 'q'\]\).*or to null if the prompts"):
        load_items(str(path), prompt_key="question", answer_key="solution")


def test_jsonl_that_is_not_utf8_names_file_line_and_byte(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "caf\xe9"}\n')  # latin-1 e-acute on line 3
    with pytest.raises(PromptDataError, match=r"p.jsonl:3: not UTF-8 \(byte 0xe9 at column 16\); save the file as UTF-8"):
        load_items(str(path), answer_key=None)


def test_jsonl_bad_rows(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(PromptDataError, match=r"p.jsonl:2: not valid JSON"):
        load_items(str(path), answer_key=None)
    path.write_text('{"prompt": ""}\n')
    with pytest.raises(PromptDataError, match=r"p.jsonl:1: 'prompt' must be a non-empty string"):
        load_items(str(path), answer_key=None)


def test_empty_sources_are_clear_errors(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(PromptDataError, match="empty.jsonl'.*prompt set is empty"):
        PromptDataModule(str(path), prompts_per_step=2).setup("fit")
    with pytest.raises(PromptDataError, match="list of 0 rows.*empty"):
        load_items([])
    with pytest.raises(PromptDataError, match="missing.jsonl': not an existing file or folder"):
        load_items(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="unknown built-in task 'nope'; known tasks: arith, arith_small"):
        load_items("builtin:nope")


def test_prompts_per_step_must_split_over_ranks():
    with pytest.raises(ValueError, match="prompts_per_step=6.*4 data-parallel ranks"):
        make_dm(rank=0, world=4, prompts_per_step=6)
    with pytest.raises(ValueError, match="without a trainer"):
        PromptDataModule().setup("fit")


def test_gsm8k_file_with_template_and_answers():
    dm = PromptDataModule(GSM8K, prompts_per_step=8, prompt_key="question", prompt_template="gsm8k", shuffle=False,
                          val_size=0)
    (batch,) = take(dm, 1)
    assert len(batch) == 8 and batch[0].text.startswith("Tom has 3 apples") and "####" in batch[0].text
    assert batch[0].answer.endswith("#### 8") and batch[0].meta["answer"] == batch[0].answer  # the raw column too
    assert dm.val_dataloader() == []  # val_size=0: no validation
    with pytest.raises(PromptDataError, match="containing '{prompt}'"):
        load_items(GSM8K, prompt_key="question", prompt_template="no placeholder")


def test_dataset_objects():
    rows = [{"prompt": f"{i}+1=", "answer": i + 1, "extra": "x"} for i in range(3)]
    records = take(PromptDataModule(rows, prompts_per_step=3, shuffle=False, val_size=0), 1)[0]
    assert [(r.text, r.answer, r.meta["extra"]) for r in records] == [
        ("0+1=", "1", "x"),
        ("1+1=", "2", "x"),
        ("2+1=", "3", "x"),
    ]
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(rows)
    assert take(PromptDataModule(ds, prompts_per_step=3, shuffle=False, val_size=0), 1)[0] == records


def test_val_batches_are_held_out_and_even_over_ranks():
    train_texts = {r.text for b in take(make_dm(), 50) for r in b}
    shards = [make_dm(rank=r, world=2, prompts_per_step=4, val_size=10).val_batches() for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 3  # ceil(10 / 4) steps on every rank
    ids = [[r.id for r in b] for b in shards[0] + shards[1]]
    assert ids[:3] == [[0, 1], [4, 5], [8, 9]] and ids[3:] == [[2, 3], [6, 7], [0, 1]]  # last step wraps
    assert not train_texts & {r.text for b in shards[0] for r in b}
    loader = make_dm(val_size=10).val_dataloader()
    assert [len(b) for b in loader] == [4, 4, 4]


def test_to_prompt_uses_the_tokenizer(tiny_policy_dir):
    from lightning_grpo.policy import PolicyConfig, load_policy

    _, tok = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    record = PromptRecord(7, "3+5=", "8", {"k": 1})
    prompt = record.to_prompt(tok)
    assert prompt.id == 7 and prompt.answer == "8" and tok.decode(prompt.token_ids) == "3+5="
    assert len(prompt.token_ids) == 4


def test_records_carry_task_items():
    item = load_items("builtin:arith", size=1)[0]
    assert isinstance(item, TaskItem) and item.text.endswith("=")
    assert json.dumps(make_dm().state_dict())  # checkpoint state is plain data


def _fit(**changes) -> PromptFit:
    """A text-only grpo run's parts, ``changes`` applied (no module: fit_prompts reads only these)."""
    parts = {"tokenizer": None, "max_prompt_tokens": None, "long_prompts": "drop", "reward_specs": [],
             "policy_path": "tiny:text", "vision": False, "objective": "grpo", "dynamic_sampling": False}
    return PromptFit(**{**parts, **changes})


def test_fit_prompts_refusals_read_only_the_parts_given():
    with pytest.raises(ValueError, match="rl.dynamic_sampling=true refills .* which LightningModule lacks"):
        fit_prompts(_fit(dynamic_sampling=True), LightningModule())
    fit_prompts(_fit(), LightningModule())  # not a PromptProvider, nothing to refill: nothing to fit
    rows = [{"prompt": "which color?", "answer": "red", "images": png((8, 8))} for _ in range(4)]
    with pytest.raises(ValueError, match="has prompts with images but policy.path='tiny:text' is a text-only model"):
        fit_prompts(_fit(), PromptDataModule(rows, prompts_per_step=2, val_size=0))
    with pytest.raises(ValueError, match="model.objective=opd does not score prompts with images"):
        fit_prompts(_fit(vision=True, objective="opd"), PromptDataModule(rows, prompts_per_step=2, val_size=0))


@pytest.mark.parametrize("max_prompt_tokens", [None, 1])
def test_prompts_that_do_not_fit_name_the_knob_the_user_set(max_prompt_tokens):
    """max_new_tokens above the context: main named rollout.max_prompt_tokens=1, a value nobody set."""
    from lightning_grpo.config import RolloutConfig
    from lightning_grpo.tiny.tokenizer import make_char_tokenizer

    rollout = RolloutConfig(max_new_tokens=1000, max_prompt_tokens=max_prompt_tokens)
    fit = _fit(tokenizer=make_char_tokenizer(), max_prompt_tokens=rollout.prompt_limit(1001),
               prompt_room=rollout.prompt_room(1001))
    dm = PromptDataModule("builtin:arith", prompts_per_step=2, val_size=0, builtin_size=8)
    if max_prompt_tokens is None:  # derived from the context: say what max_new_tokens left
        says = (r"^rollout.max_new_tokens=1000 leaves 1 token of a 1001-token context \(the policy's "
                r"max_position_embeddings\) for the prompt, and the shortest prompt that does not fit has \d+ tokens; "
                r"lower rollout.max_new_tokens")
    else:  # set by the user: that knob
        says = r"8 of 8 prompts are longer than rollout.max_prompt_tokens=1"
    with pytest.raises(ConfigError, match=says):
        fit_prompts(fit, dm)


def test_the_prompt_room_names_the_engine_context_when_smaller():
    from lightning_grpo.config import RolloutConfig, ServerConfig

    rollout = RolloutConfig(engine="vllm_server", max_new_tokens=60, server=ServerConfig(max_model_len=64))
    assert rollout.prompt_room(256) == ("rollout.max_new_tokens=60 leaves 4 tokens of a 64-token context "
                                        "(rollout.server.max_model_len) for the prompt")
    assert RolloutConfig(max_new_tokens=8).prompt_room(None) is None  # no context known: nothing derived


def test_prompt_fit_of_a_built_policy_reads_the_sections():
    """``PromptFit.of`` (``GRPOModule.check_data``): the limit is what ``max_new_tokens`` leaves of the context, and
    that room is named; a set ``max_prompt_tokens`` wins and names nothing."""
    from lightning_grpo.config import GRPOConfig, RolloutConfig

    rl = GRPOConfig(dynamic_sampling=True)
    derived = PromptFit.of("tok", 64, RolloutConfig(max_new_tokens=16), rl, None, "tiny:x", False, "grpo")
    assert (derived.max_prompt_tokens, derived.reward_specs, derived.dynamic_sampling) == (48, [], True)
    assert "rollout.max_new_tokens=16 leaves 48 tokens" in derived.prompt_room
    fixed = PromptFit.of("tok", 64, RolloutConfig(max_prompt_tokens=20), rl, None, None, True, "opd")
    assert (fixed.max_prompt_tokens, fixed.prompt_room, fixed.vision, fixed.objective) == (20, None, True, "opd")
