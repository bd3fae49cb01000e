"""Multi-turn environments: token in token out with a BPE tokenizer that drifts under decode -> encode, masks and
divisor against an independent count, chunked == unchunked in float64, tool-call failures as feedback, refusals."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from dataclasses import replace as dc_replace

import pytest
import torch
from helpers import max_rel_delta, params_of
from lightning.pytorch import Callback
from test_loss_family import bare
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from lightning_grpo.batch import pack_rollouts
from lightning_grpo.config import ConfigError
from lightning_grpo.envs import EnvConfig, EpisodeRunner, ToolCall, load_env, parse_hermes, parse_pythonic
from lightning_grpo.envs.template import TurnDelta
from lightning_grpo.logprobs import token_logprobs
from lightning_grpo.metrics import roll_up
from lightning_grpo.objectives.grpo import GRPOObjective
from lightning_grpo.rollout.base import Prompt, SamplingConfig
from lightning_grpo.rollout.hf import HFEngine
from lightning_grpo.update import Needs, Split

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier

QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5's layout of tools and tool turns (consecutive tool results share one user turn), in fewer lines."""

CORPUS = ["the tool add returns the sum of two numbers", "what is 1234 + 5678 ? call the tool then answer",
          '{"type": "function", "function": {"name": "add", "description": "Add two integers exactly."}}',
          '{"parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}}',
          "system user assistant tool tools response tool_response submit multiply 0123456789 <>/_|:,.!?'\n"] * 3


def bpe_tokenizer():
    """A BPE with merges (built locally, no download): decoding sampled ids and encoding the text back often gives
    other ids (``ab`` sampled as ``a`` + ``b`` comes back as the merged ``ab``)."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"], show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>")
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = QWEN_LIKE_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A tiny GPT-2 in float64 over the BPE's vocabulary (float64 end to end: no float32 upcast inside)."""
    path = tmp_path_factory.mktemp("gpt2-envs")
    tok = bpe_tokenizer()
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=len(tok), n_positions=1024, bos_token_id=None, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=tok.eos_token_id, torch_dtype="float64")
    torch.manual_seed(0)
    GPT2LMHeadModel(config).double().save_pretrained(path)
    tok.save_pretrained(path)
    return path


class Recording:
    """The real engine, with every turn's sampled ids and logprobs kept by episode id (the independent record)."""

    def __init__(self, engine) -> None:
        self.engine, self.turns = engine, {}

    def generate(self, prompts, group_size, sampling):
        outs = self.engine.generate(prompts, group_size, sampling)
        for p, r in zip(prompts, outs):
            self.turns.setdefault(p.id, []).append((list(r.token_ids), list(r.logprobs or [])))
        return outs


def check_vllm_episodes(engine, tok, model) -> None:
    """Plays AddOnly episodes (3 prompts x 2) through ``engine`` and checks token in, token out: episodes end at
    different turns, tool results sit between model turns with mask 0, the trained ids are the sampled ones, and
    ``model``'s logprobs meet the sampler's on every model token (1e-4, float32; both vLLM engines)."""
    recording = Recording(engine)
    runner = EpisodeRunner(EnvConfig(name="test_envs:AddOnly", parser="test_envs:add_every_turn", max_turns=3),
                           tok, [tok.eos_token_id], context=256)
    prompts = [Prompt(id=i, token_ids=[], text=f"{10 + i}+{20 + i}=", answer=str(30 + 2 * i)) for i in range(3)]
    sampling = SamplingConfig(max_new_tokens=6, seed=5, logprobs=True, stop=(" ", "+"))
    rollouts, metrics = runner.play(recording, prompts, 2, sampling)
    assert 1 < metrics["episode/turns_mean"] < 3  # episodes that end at different turns, batched turn by turn
    assert any(not m for r in rollouts for m in r.model_mask)  # tool results between turns: context, never trained
    batch = pack_rollouts(rollouts, torch.ones(len(rollouts)), torch.zeros(len(rollouts)), tok.pad_token_id)
    for i, r in enumerate(rollouts):
        sampled = [t for ids, _ in recording.turns[r.prompt.id] for t in ids]
        assert batch.input_ids[i][batch.completion_mask[i]].tolist() == sampled
    with torch.no_grad():
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask.long(), positions=batch.completion_mask[:, 1:])
    mask = batch.completion_mask[:, 1:]
    torch.testing.assert_close(lp[mask].float(), batch.rollout_logprobs[:, 1:][mask], atol=1e-4, rtol=0)


def add_every_turn(text: str) -> list[ToolCall | str]:
    """A parser (the documented hook) that reads every turn as a call, so a random policy plays long episodes."""
    return [ToolCall("add", {"a": 98765, "b": len(text)})]


def play(model_dir, n_prompts=4, group=2, **env):
    """Episodes of the calculator with a random float64 GPT-2 through the transformers engine."""
    tok = bpe_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    # Turns end on any of a fifth of the vocabulary (or the end-of-turn token): a random policy's turns stay short.
    eos = [tok.eos_token_id, *range(10, len(tok), 5)]
    engine = Recording(HFEngine(model, tok, eos_token_ids=eos))
    runner = EpisodeRunner(EnvConfig(**{"parser": "test_envs:add_every_turn", "max_turns": 3, **env}), tok, [tok.eos_token_id])
    prompts = [Prompt(id=i, token_ids=[], text=f"what is {1234 + i} + 5678 ?", answer=str(6912 + i))
               for i in range(n_prompts)]
    rollouts, metrics = runner.play(engine, prompts, group, SamplingConfig(max_new_tokens=8, seed=3, logprobs=True))
    return tok, model, engine, runner, rollouts, metrics


@pytest.fixture(scope="module")
def episodes(gpt2_dir):
    """The default episodes (deterministic: seeded sampling), played once for the tests that only read them."""
    return play(gpt2_dir)


def test_trained_ids_are_the_sampled_ids_and_tool_tokens_are_context(episodes):
    tok, _, engine, runner, rollouts, metrics = episodes
    batch = pack_rollouts(rollouts, torch.ones(len(rollouts)), torch.zeros(len(rollouts)), tok.pad_token_id)
    drifted = 0
    for i, r in enumerate(rollouts):
        turns = engine.turns[r.prompt.id]
        sampled = [t for ids, _ in turns for t in ids]
        trained = batch.input_ids[i][batch.completion_mask[i]].tolist()
        assert trained == sampled  # exactly the ids the sampler drew, in order
        # what a text-based trainer would train on: the episode decoded, then encoded again
        drifted += tok(tok.decode(r.token_ids), add_special_tokens=False)["input_ids"] != r.token_ids
        # between two model turns: exactly the template's delta for the tool result, as ids, mask 0
        p, mask = len(r.prompt.token_ids), torch.tensor(r.model_mask)
        context = batch.input_ids[i, p: p + len(mask)][~mask].tolist()
        expected = []
        for ids, _ in turns[:-1]:
            expected += TurnDelta(tok, runner.env_class.schemas, [tok.eos_token_id]).ids(
                [("add", str(98765 + len(tok.decode(ids, skip_special_tokens=True))))], ids[-1])
        assert context == expected[: len(context)] and (len(turns) == 1 or context)
        assert batch.rollout_logprobs[i][~batch.completion_mask[i]].eq(0).all()
        assert batch.rollout_logprobs[i][batch.completion_mask[i]].tolist() == pytest.approx(
            [lp for _, lps in turns for lp in lps], abs=1e-6)
    assert drifted > 0, "the tokenizer must show drift for this test to mean anything"
    assert metrics["episode/turns_mean"] > 1.5 and metrics["tools/call_frequency"] > 0.5


def test_the_transcript_is_every_turn_its_calls_their_results_and_the_opening_the_model_saw(episodes):
    """What completions.jsonl shows of an episode, against the engine's own record of each turn and the token mask."""
    tok, _, engine, runner, rollouts, _ = episodes
    for r in rollouts:
        turns, sampled = r.transcript.turns, engine.turns[r.prompt.id]
        assert [t.tokens for t in turns] == [len(ids) for ids, _ in sampled]
        assert sum(t.tokens for t in turns) == sum(r.model_mask)  # the trained ids
        assert sum(t.context_tokens for t in turns) == r.model_mask.count(False)  # the context ids
        assert turns[-1].text == r.text  # what the reward functions read
        for turn in turns:
            if turn.context_tokens:  # a turn whose results the model read: the parser's call, the tool's answer
                (call,) = turn.calls
                b = len(turn.text)
                assert call == {"name": "add", "arguments": {"a": 98765, "b": b}, "result": str(98765 + b),
                                "failed": False}
        assert tok(r.transcript.opening, add_special_tokens=False)["input_ids"] == r.prompt.token_ids
        assert '"name": "add"' in r.transcript.opening  # the tool schema the model read
    assert any(len(r.transcript.turns) > 1 for r in rollouts)


def test_an_environments_reward_is_shown_as_its_reward_part(episodes):
    from lightning_grpo.collect import RewardScorer

    rollouts = episodes[4]
    scorer = RewardScorer(None)
    total, _ = scorer(rollouts)
    assert [scorer.parts.of(r) for r in rollouts] == [{"environment": float(t)} for t in total]


def test_sampler_logprobs_equal_the_trainers_on_multi_turn_episodes(episodes):
    """The drift check: the trainer scores the record and meets the sampler on every model token, in float64."""
    tok, model, _, _, rollouts, _ = episodes
    batch = pack_rollouts(rollouts, torch.ones(len(rollouts)), torch.zeros(len(rollouts)), tok.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask.long(), positions=batch.completion_mask[:, 1:])
    mask = batch.completion_mask[:, 1:]
    assert torch.allclose(lp[mask], batch.rollout_logprobs[:, 1:][mask].double(), atol=1e-5)


def test_the_divisor_counts_model_tokens_only(episodes):
    tok, model, engine, _, rollouts, _ = episodes
    independent = sum(len(ids) for turns in engine.turns.values() for ids, _ in turns)
    batch = pack_rollouts(rollouts, torch.randn(len(rollouts)), torch.zeros(len(rollouts)), tok.pad_token_id)
    assert int((batch.attention_mask & ~batch.completion_mask).sum()) > sum(len(r.prompt.token_ids) for r in rollouts)
    lp = token_logprobs(model, batch.input_ids, batch.attention_mask.long(), positions=batch.completion_mask[:, 1:])
    obj = GRPOObjective(0.2, 0.28, loss_type="dapo")
    _, denom, _ = obj(lp, batch.completion_mask[:, 1:], batch.advantages.double())
    assert int(batch.completion_mask.sum()) == independent
    assert float(denom) == independent


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_chunked_equals_unchunked_on_multi_turn_episodes(gpt2_dir, episodes, loss_type):
    """Token-mean and sequence-mean divisors, with tool results between model turns: every split is exact."""
    tok, _, _, _, rollouts, _ = episodes
    g = torch.Generator().manual_seed(0)
    batch = pack_rollouts(rollouts, torch.randn(len(rollouts), generator=g), torch.zeros(len(rollouts)),
                          tok.pad_token_id)
    obj = GRPOObjective(0.01, 0.01, loss_type=loss_type, max_completion_length=8 * 3)
    runs = {name: bare(gpt2_dir, Split(rows=8, mu_iterations=2, **kw), obj, Needs(pi_old=True), lr=1.0)
            for name, kw in (("whole", {}), ("fixed", {"n_micro": 4}), ("budget", {"max_tokens_per_micro": 1400}))}
    before = params_of(runs["whole"].policy)
    results = {name: roll_up(u.update(batch)) for name, u in runs.items()}
    assert runs["fixed"].last_plan.real_chunks == 4 and runs["budget"].last_plan.real_chunks > 1
    for name in ("fixed", "budget"):
        assert max_rel_delta(before, params_of(runs["whole"].policy), params_of(runs[name].policy)) <= 5e-8
        for metric in ("grpo/loss", "grpo/denom"):
            assert results[name][metric] == pytest.approx(results["whole"][metric], rel=1e-12), metric


# -- the template's delta ---------------------------------------------------------------------------------------------
THINKING_TEMPLATE = QWEN_LIKE_TEMPLATE.replace(
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}",
    "{%- else %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and loop.last %}<think>\n\n</think>\n\n"
    "{% endif %}{{ m.content }}")
"""Qwen3's quirk: only the last assistant turn gets an (empty) think block, so rendering with and without the tool
messages differs before the model's turn, and a plain diff of the two renderings would not be a suffix."""


@pytest.mark.parametrize("template", [QWEN_LIKE_TEMPLATE, THINKING_TEMPLATE], ids=["qwen2.5", "qwen3-think"])
def test_the_delta_is_the_templates_own_text_after_the_model_turn(template):
    tok = bpe_tokenizer()
    tok.chat_template = template
    assert "<think>" in tok.apply_chat_template([{"role": "user", "content": "u"}, {"role": "assistant",
                                                 "content": "a"}], tokenize=False) or template is QWEN_LIKE_TEMPLATE
    delta = TurnDelta(tok, [], [tok.eos_token_id])
    after = ("<|im_start|>user<tool_response>\n42\n</tool_response><tool_response>\n7\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n")  # both results in one user turn, then the next assistant opening
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    # the turn ended on the end-of-turn token: the delta goes on from the template's text after it
    assert delta.ids([("add", "42"), ("add", "7")], tok.eos_token_id) == ids("\n" + after)
    # the turn ended on a stop string: the template's end of turn is part of the delta
    assert delta.ids([("add", "42"), ("add", "7")], ids(")")[-1]) == ids("<|im_end|>\n" + after)


def test_a_template_that_rewrites_the_assistant_content_is_refused():
    tok = bpe_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content | lower }}\n{% endfor %}"
    with pytest.raises(ValueError, match="does not render an assistant message's content verbatim"):
        TurnDelta(tok, [], [tok.eos_token_id]).ids([("add", "1")], tok.eos_token_id)


# -- tool calls: parsing, failures as feedback -------------------------------------------------------------------------
def test_hermes_calls_are_parsed_and_malformed_ones_become_errors():
    text = ('a<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> b '
            '<tool_call>{"name": "mul", "arguments": "{\\"a\\": 3}"}</tool_call><tool_call>{oops}</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "submit", "arguments": {"answer": 7}}')
    calls = parse_hermes(text)
    assert calls[:2] == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("mul", {"a": 3})]
    assert "not valid JSON" in calls[2] and "needs" in calls[3]
    assert calls[4] == ToolCall("submit", {"answer": 7})  # unclosed last call: read
    assert parse_hermes("no call here") == []


def test_pythonic_calls_are_parsed_and_unreadable_ones_become_errors():
    calls = parse_pythonic("add(a=12, b=34) then submit(answer=46) add(1, 2) add(a=b) 3+4=(7)")
    assert calls[:2] == [ToolCall("add", {"a": 12, "b": 34}), ToolCall("submit", {"answer": 46})]
    assert len(calls) == 4 and all(c.startswith("Error: could not read the call add(") for c in calls[2:])
    # a turn that stopped on ")" comes back with the text cut before it: its last call is still read
    assert parse_pythonic("add(a=12, b=34) submit(answer=46") == calls[:2]
    assert parse_pythonic("add(a=12) b=34") == [ToolCall("add", {"a": 12})]  # only at the very end


class Flaky:
    """A test environment with a raising tool and a hanging one."""

    reward = 0.0

    def reset(self, **row) -> None:
        return None

    def boom(self, x: int) -> int:
        """Raise.

        Args:
            x: ignored.
        """
        raise RuntimeError("kaput")

    def hang(self, x: int) -> int:
        """Sleep past the timeout.

        Args:
            x: seconds.
        """
        time.sleep(x)
        return x


@pytest.mark.parametrize("call,message", [
    ("Error: the tool call is not valid JSON", "not valid JSON"),  # the parser's error string
    (ToolCall("nope", {}), "unknown tool 'nope'"),
    (ToolCall("boom", {}), "missing arguments ['x']"),
    (ToolCall("boom", {"x": "1"}), "is not of type integer"),
    (ToolCall("boom", {"x": True}), "is not of type integer"),
    (ToolCall("boom", {"x": 1}), "raised RuntimeError: kaput"),
    (ToolCall("hang", {"x": 5}), "timed out after 0.2 s"),
])
def test_every_bad_call_is_a_failure_returned_to_the_model(call, message):
    from lightning_grpo.envs.episode import _Episode

    tok = bpe_tokenizer()
    cfg = EnvConfig(name="test_envs:Flaky", tool_timeout_s=0.2, max_tool_response_tokens=1000)
    runner = EpisodeRunner(cfg, tok, [tok.eos_token_id])
    e = _Episode(Prompt(id=0, token_ids=[1]), *runner.env_class.new())
    start = time.monotonic()
    _, text = runner._result_text(e, call, runner._run(e, call))
    assert message in text and text.startswith("Error") and (e.calls, e.failures) == (1, 1)
    assert time.monotonic() - start < 2


def test_a_long_tool_result_is_cut_and_counted(gpt2_dir):
    *_, metrics = play(gpt2_dir, n_prompts=1, max_tool_response_tokens=1)
    assert metrics["episode/tool_results_cut"] > 0


def test_max_total_tokens_bounds_every_episode_and_counts_truncation(gpt2_dir, episodes):
    rollouts, metrics = episodes[4:]
    opening = max(len(r.prompt.token_ids) for r in rollouts)
    _, _, _, _, capped, capped_metrics = play(gpt2_dir, max_total_tokens=opening + 12)
    assert all(len(r.prompt.token_ids) + len(r.token_ids) <= opening + 12 for r in capped)
    assert all(r.finish_reason == "length" for r in capped) and capped_metrics["episode/truncated_frac"] == 1.0
    assert capped_metrics["episode/turns_mean"] < metrics["episode/turns_mean"]
    with pytest.raises(ValueError, match="raise max_total_tokens"):
        play(gpt2_dir, max_total_tokens=opening)


class SlowAdd:
    """An environment whose tool waits like an HTTP call (sleeping releases the GIL) and records how many calls
    were running at once (class-level: shared by every episode's instance, for the test's eyes only)."""

    SECONDS = 0.4
    lock, running, most = threading.Lock(), 0, 0
    spans: list[tuple[float, float]] = []  # (start, end) of every call
    reward = 0.0

    def reset(self, **row) -> None:
        self.total = 0

    def add(self, a: int, b: int) -> int:
        """Add two integers slowly.

        Args:
            a: first.
            b: second.
        """
        cls = type(self)
        with cls.lock:
            cls.running += 1
            cls.most = max(cls.most, cls.running)
        start = time.monotonic()
        time.sleep(self.SECONDS)
        with cls.lock:
            cls.running -= 1
            cls.spans.append((start, time.monotonic()))
        self.total += a + b  # per-episode state: each turn's result depends on this episode's earlier calls
        self.reward = float(self.total % 7)
        return self.total


def test_tool_workers_overlap_the_episodes_tool_calls_and_change_nothing(gpt2_dir):
    """The same seeded episodes with tool calls one at a time and on 8 threads: identical ids, masks, sampler
    logprobs, rewards and metrics; the calls overlapped (seen inside the tool) and the tool time shrank."""
    runs = {}
    for workers in (1, 8):
        SlowAdd.running = SlowAdd.most = 0
        SlowAdd.spans = []
        *_, rollouts, metrics = play(gpt2_dir, name="test_envs:SlowAdd", tool_workers=workers)
        runs[workers] = rollouts, metrics, SlowAdd.most, busy_seconds(SlowAdd.spans)
    (one, m1, most1, t1), (eight, m8, most8, t8) = runs[1], runs[8]
    assert m1["tools/call_frequency"] >= 1 and m1 == m8, m1
    assert [(r.prompt.token_ids, r.token_ids, r.model_mask, r.logprobs, r.reward) for r in one] == \
           [(r.prompt.token_ids, r.token_ids, r.model_mask, r.logprobs, r.reward) for r in eight]
    assert len({r.reward for r in one}) > 1  # the rewards depend on each episode's own calls
    assert most1 == 1 and most8 >= 4, (most1, most8)
    calls = m1["tools/call_frequency"] * len(one)
    # Wall time while any tool call ran (the model's own forwards excluded: on a loaded machine they swing by seconds
    # between the two runs, more than the tool time saved; measured whole-run wall times 4.25 s vs 3.94 s once).
    assert t1 >= calls * SlowAdd.SECONDS  # one at a time: every call's sleep in turn
    assert t8 < 0.5 * t1, (t1, t8, calls)  # at least half the serial tool time saved


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """Length of the union of the (start, end) intervals: the wall time during which at least one ran."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


# -- a TRL environment_factory class, unchanged -----------------------------------------------------------------------
class GuessEnv:
    """Written as TRL documents ``environment_factory``: reset(**kwargs) -> observation, tools, ``self.reward``."""

    def __init__(self):
        self.reward = 0.0
        self.target = None

    def reset(self, **kwargs) -> str | None:
        self.target = kwargs["answer"]
        self.reward = 0.0
        return " use the guess tool."

    def guess(self, value: int) -> str:
        """Guess the number.

        Args:
            value: the guess.
        """
        self.reward = float(str(value) == self.target)
        return "correct" if self.reward else "wrong"


def guess_6912(text: str) -> list[ToolCall | str]:
    return [ToolCall("guess", {"value": 6912})]


def test_a_trl_environment_runs_unchanged(gpt2_dir):
    tok, _, _, runner, rollouts, _ = play(gpt2_dir, n_prompts=2, name="test_envs:GuessEnv", parser="test_envs:guess_6912",
                                          max_turns=2)
    assert [t["function"]["name"] for t in runner.env_class.schemas] == ["guess"]
    assert all("what is 1234 + 5678 ? use the guess tool." in tok.decode(r.prompt.token_ids) for r in rollouts[:2])
    assert '"name": "guess"' in tok.decode(rollouts[0].prompt.token_ids)  # the schema is in the system turn
    # read from env.reward: 1 where the guess ran (a tool result follows a turn) and the answer is 6912 (prompt 0)
    called = [not all(r.model_mask) for r in rollouts]
    assert [r.reward for r in rollouts] == [float(c and r.prompt.answer == "6912") for c, r in zip(called, rollouts)]
    assert 1.0 in [r.reward for r in rollouts]


# -- refusals at setup ------------------------------------------------------------------------------------------------
class NoDoc:
    def reset(self, **row):
        return None

    def act(self, x: int) -> int:
        return x


class BadType:
    def reset(self, **row):
        return None

    def act(self, x: set) -> int:
        """Act.

        Args:
            x: a set.
        """
        return len(x)


class NeedsArgs:
    def __init__(self, size):
        self.size = size

    def reset(self, **row):
        return None


@pytest.mark.parametrize("name,message", [
    ("no_such_pkg.envs:MyEnv", "cannot import module 'no_such_pkg.envs'"),
    ("sokoban", "not a built-in (calculator) or 'module:Class'"),
    ("test_envs:Missing", "has no attribute 'Missing'"),
    ("test_envs:add_every_turn", "is not a class with a reset"),
    ("test_envs:NoDoc", "tool 'act' cannot be described to the model"),
    ("test_envs:BadType", "tool 'act' has an argument type JSON cannot carry"),
    ("test_envs:NeedsArgs", "is built with no arguments"),
])
def test_a_bad_environment_is_refused_naming_the_fix(name, message):
    tok = bpe_tokenizer()
    with pytest.raises(ValueError, match=re.escape(message)):
        EpisodeRunner(EnvConfig(name=name), tok, [tok.eos_token_id])


def test_max_total_tokens_below_the_tool_schemas_is_refused_at_setup():
    tok = bpe_tokenizer()
    with pytest.raises(ValueError, match=r"max_total_tokens=20 \(model context None\) leaves no room: an empty prompt"):
        EpisodeRunner(EnvConfig(max_total_tokens=20), tok, [tok.eos_token_id])


def test_a_tokenizer_without_chat_template_and_an_unknown_parser_are_refused():
    tok = bpe_tokenizer()
    with pytest.raises(ValueError, match="model.env.parser='mistral': not a registered parser"):
        EpisodeRunner(EnvConfig(parser="mistral"), tok, [tok.eos_token_id])
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        EpisodeRunner(EnvConfig(), tok, [tok.eos_token_id])


@pytest.mark.parametrize("kw,names", [
    ({"max_turns": 0}, "max_turns=0"), ({"max_tool_response_tokens": -1}, "max_tool_response_tokens=-1"),
    ({"max_total_tokens": 1}, "max_total_tokens=1"), ({"tool_timeout_s": 0}, "tool_timeout_s=0"),
    ({"name": ""}, "name=''"), ({"tool_workers": 0}, "tool_workers=0"), ({"tool_workers": 2.5}, "tool_workers=2.5"),
])
def test_env_config_rules(kw, names):
    with pytest.raises(ConfigError, match=re.escape(names)):
        EnvConfig(**kw)


def test_the_builtin_calculator_scores_one_submission():
    env, tools = load_env("calculator").new()
    env.reset(prompt="what is 123456 * 789 ?", answer="97406784")
    assert tools["multiply"].fn(a=123456, b=789) == 97406784
    assert tools["submit"].fn(answer=97406784) == "submitted" and env.reward == 1.0
    assert tools["submit"].fn(answer=1) == "already submitted" and env.reward == 1.0


# -- the module: model.env wires episodes into a loop step --------------------------------------------------------------
class AddOnly:
    """An environment without a reward: the run's reward functions score its episodes."""

    def reset(self, **row) -> None:
        return None

    def add(self, a: int, b: int) -> int:
        """Add.

        Args:
            a: one.
            b: two.
        """
        return a + b


@pytest.mark.heavy  # a fit: CI and `make test-integration`
def test_a_grpo_loop_step_trains_on_episodes(tiny_chat_policy_dir, tmp_path):
    from helpers import StepRecorder, fit_tiny, tiny_grpo_module

    from lightning_grpo.completions import CompletionLog

    steps = StepRecorder()
    fit_tiny(episode_module(tiny_chat_policy_dir), tmp_path, loop_steps=2,
             callbacks=[steps, CompletionLog(samples_per_step=2, log_completions_every=0)])
    for m in steps.metrics:
        assert m["tools/call_frequency"] > 0 and 1 < m["episode/turns_mean"] <= 2 and "episode/truncated_frac" in m
        assert m["reward/std"] > 0 and m["grpo/loss"] != 0.0
        assert m["grpo/tokens"] == 8 * m["completion/len_mean"]  # lengths count model tokens, like the loss
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2, 2]
    for r in rows:  # the whole episode, not only its last turn; the prompt as rendered; the reward functions' parts
        assert r["turns"] and r["turns"][-1]["text"] == r["completion"] and r["prompt"].endswith("assistant: ")
        assert set(r["rewards"]) == {"helpers:digit_share"} and r["trained"]
    calls = [c for r in rows for t in r["turns"][:-1] for c in t["calls"]]
    assert calls and all(c["name"] == "add" and c["result"] == str(98765 + c["arguments"]["b"]) for c in calls)
    bad = tiny_grpo_module(tiny_chat_policy_dir)
    bad.env_cfg = EnvConfig(name="nowhere:Env")
    with pytest.raises(ValueError, match="cannot import module 'nowhere'"):
        fit_tiny(bad, tmp_path / "bad", loop_steps=1)


def episode_module(policy_dir):
    from dataclasses import replace as dc_replace

    from helpers import tiny_grpo_module

    module = tiny_grpo_module(policy_dir)  # rewards: helpers:digit_share on the last turn's text
    module.env_cfg = EnvConfig(name="test_envs:AddOnly", parser="test_envs:add_every_turn", max_turns=2)
    module.rollout_cfg = dc_replace(module.rollout_cfg, max_new_tokens=6, stop=[" ", "+"])  # short turns
    return module


def test_validation_plays_one_greedy_episode_per_held_out_prompt(tiny_chat_policy_dir):
    """With model.env, val/* score whole episodes (the training path, its stop strings) and report their tool and
    episode metrics; val/len_mean counts the model's tokens, not the tool results."""
    from lightning_grpo.collect.prompts import step_prompts
    from lightning_grpo.data.prompts import PromptDataModule
    from lightning_grpo.validation import greedy_scores

    module = episode_module(tiny_chat_policy_dir)
    module.configure_model()
    module.engine = module.build_engine(will_sleep=False)
    module.collector = module.configure_collector()
    records = PromptDataModule("builtin:arith", prompts_per_step=4, val_size=4, chat=True).val_batches()[0]
    runner, draws = module.episodes, []
    play = runner.play
    runner.play = lambda engine, prompts, g, sampling: draws.append((g, sampling)) or play(engine, prompts, g, sampling)
    first, again = greedy_scores(module.collector, records, module.loop_step), greedy_scores(module.collector, records, module.loop_step)
    assert first == again  # greedy episodes: the same every time
    (group, sampling), _ = draws
    assert (group, sampling.temperature, sampling.stop) == (1, 0.0, module.sampling().stop)
    prompts, _ = step_prompts(records, module.tokenizer, None, "error")
    episodes, metrics = play(module.engine, prompts, 1, sampling)
    assert {f"val/{k}": v for k, v in metrics.items()}.items() <= first.items()
    assert first["val/tools/call_frequency"] > 0 and 1 < first["val/episode/turns_mean"] <= 2
    assert first["val/reward"] == pytest.approx(float(module.compute_rewards(episodes)[0].mean()))
    model_tokens = [sum(e.model_mask) for e in episodes]
    assert first["val/len_mean"] == sum(model_tokens) / 4 < sum(len(e.token_ids) for e in episodes) / 4


@pytest.mark.heavy  # two fits: CI and `make test-integration`
def test_a_multi_turn_run_resumes_exactly(tiny_chat_policy_dir, tmp_path):
    """Episodes are seeded per (loop step, turn, episode) and environments live one episode: a resume replays the
    uninterrupted run row for row."""
    from helpers import StepRecorder, fit_tiny, global_determinism_restored
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_grpo.timing import is_timing

    with global_determinism_restored():
        whole, ckpt = StepRecorder(), ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}",
                                                      every_n_train_steps=2, save_top_k=-1)
        fit_tiny(episode_module(tiny_chat_policy_dir), tmp_path / "a", loop_steps=3, callbacks=[whole, ckpt])
        resumed = StepRecorder()
        fit_tiny(episode_module(tiny_chat_policy_dir), tmp_path / "b", loop_steps=3, callbacks=[resumed],
                 ckpt_path=tmp_path / "ckpt" / "step=1.ckpt")
    rows = [[{k: v for k, v in r.items() if not is_timing(k)} for r in run] for run in (whole.metrics[1:],
                                                                                            resumed.metrics)]
    assert rows[0] == rows[1] and resumed.prompt_ids == whole.prompt_ids[1:]
    assert all(r["tools/call_frequency"] > 0 for r in rows[1])


@pytest.mark.heavy  # the tools quickstart's fit: CI and `make test-integration`
def test_the_tools_quickstart_runs_as_shipped(tmp_path, monkeypatch):
    """configs/tools-quickstart.yaml through the CLI, shortened to 2 loop steps and 8 held-out prompts, its warm start
    the shipped one (copied, not trained): episodes and their metrics logged. (That it learns, as shipped:
    tests/test_quickstart.py.)"""
    import csv
    from pathlib import Path

    from lightning_grpo.cli import main

    monkeypatch.chdir(tmp_path)
    config = Path(__file__).parents[2] / "configs" / "tools-quickstart.yaml"
    main(["fit", "--config", str(config), "--trainer.max_steps=2", "--data.val_size=8"])
    rows = [r for r in csv.DictReader((tmp_path / "runs/tools-quickstart/version_0/metrics.csv").open())
            if r.get("episode/turns_mean")]
    assert len(rows) == 2
    for r in rows:
        assert 1 <= float(r["episode/turns_mean"]) <= 3 and 0 <= float(r["episode/truncated_frac"]) <= 1
        assert float(r["tools/call_frequency"]) >= float(r["tools/failure_frequency"]) >= 0
    assert any(float(r["tools/call_frequency"]) > 0 for r in rows)  # the shipped warm start writes calls


@pytest.mark.parametrize("parser", ["os:system", "builtins:eval", "subprocess:getoutput", "shutil:rmtree"])
def test_a_standard_library_callable_is_refused_as_the_tool_call_parser(parser):
    """The parser is handed the model's generated text: a stdlib callable there would run it with the user's rights."""
    from lightning_grpo.envs.environment import load_parser

    with pytest.raises(ValueError, match=rf"model.env.parser='{parser}' is a function of Python's standard library"):
        load_parser(parser)


def test_a_parser_of_the_users_own_module_is_loaded():
    from lightning_grpo.envs.environment import load_parser

    assert load_parser("test_envs:add_every_turn") is add_every_turn


# -- issue 47: protocol breaks an environment made silently -----------------------------------------------------------
class DictReset(AddOnly):
    """``reset`` returns a dict (a gymnasium-style observation): it was formatted into the prompt as its repr."""

    def reset(self, **row) -> dict:
        return {"text": " use add.", "info": {}}


class NaNReward(AddOnly):
    """An episode reward of NaN once ``BROKEN`` is set (a scoring bug that shows up mid-run)."""

    BROKEN = False

    @property
    def reward(self) -> float | None:
        return math.nan if NaNReward.BROKEN else 1.0


def test_a_reset_that_returns_a_dict_is_refused_naming_the_fix(gpt2_dir):
    from lightning_grpo.envs.environment import EnvProtocolError

    with pytest.raises(EnvProtocolError) as err:
        play(gpt2_dir, n_prompts=1, name="test_envs:DictReset", max_turns=1)
    assert str(err.value).startswith("DictReset.reset returned a dict ({'text': ' use add.', 'info': {}}); reset "
                                     "returns the first observation as a str")


@pytest.mark.heavy  # a fit: CI and `make test-integration`
def test_a_nan_environment_reward_stops_the_run_at_that_loop_step(tiny_chat_policy_dir, tmp_path):
    """A NaN episode reward made the loss NaN; the skipped updates did not count toward max_steps, so a
    max_steps=2 run went on for 9 skipped loop steps before max_consecutive_skips stopped it. It is refused where
    it is read, like a reward function's NaN: the run stops at that loop step, its boundary saved."""
    from helpers import fit_tiny

    from lightning_grpo.checkpoint import GRPOCheckpoint, checkpoint_name, read_manifest
    from lightning_grpo.envs.environment import EnvProtocolError

    class BreakAtStep2(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            NaNReward.BROKEN = pl_module.loop_step == 1

    module = episode_module(tiny_chat_policy_dir)
    module.env_cfg = dc_replace(module.env_cfg, name="test_envs:NaNReward")
    saver = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=10)
    try:
        with pytest.raises(EnvProtocolError, match=r"NaNReward.reward is nan for an episode of model.env; an "
                                                   r"episode reward must be a finite number"):
            fit_tiny(module, tmp_path, loop_steps=2, callbacks=[BreakAtStep2(), saver])
    finally:
        NaNReward.BROKEN = False
    assert read_manifest(saver.dirpath / checkpoint_name(1, saver.lineage)).reason == "error:EnvProtocolError"
