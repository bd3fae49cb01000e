"""The engine protocol's contract (rollout/base.py), one suite parametrized over every engine: transformers (hf),
replay, vLLM in-process (``vllm``) and ``vllm serve`` (``vllm_server``: launches a server, so ``slow``).

Each engine serves the trainer's tiny policy (float32). What every caller relies on: groups in prompt order, seeds
that couple no groups (a row's tokens depend on its prompt id and the seed, never on the batch or another prompt),
stop strings, sampler logprobs equal to the trainer's, token-in token-out episodes, and a weight sync that the next
draw follows. Replay serves records sampled by the same policy, so it meets the same contract where it applies
(it draws nothing: seeds and stop strings are not its to honour).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import pytest
import torch
from helpers import first_token_spread

from lightning_grpo.policy import PolicyConfig, load_policy
from lightning_grpo.rollout.base import Closable, Prompt, RolloutEngine, SamplingConfig
from lightning_grpo.rollout.vllm_server import sequence_logprobs
from lightning_grpo.rollout.weight_sync import push_weights

pytestmark = pytest.mark.contract

ENGINES = [
    pytest.param("hf", id="hf"),
    pytest.param("replay", id="replay"),
    pytest.param("vllm", id="vllm", marks=pytest.mark.vllm),
    pytest.param("vllm_server", id="vllm_server", marks=[pytest.mark.vllm, pytest.mark.slow]),
]


@dataclass
class Case:
    """One engine around the trainer's policy; ``atol``: how close its sampler logprobs come to the trainer's."""

    name: str
    engine: RolloutEngine
    model: torch.nn.Module
    tok: object
    atol: float

    @property
    def draws(self) -> bool:
        """Whether it samples (replay serves records)."""
        return self.name != "replay"

    def publish(self) -> None:
        push_weights(self.model, self.engine)


def texts(tok, *words: str) -> list[Prompt]:
    return [Prompt(id=i, token_ids=tok(t)["input_ids"], text=t) for i, t in enumerate(words)]


def record(model, tok, path) -> None:
    """A replay file drawn by the policy itself (hf engine): 3 groups of 4, with the sampler's logprobs."""
    from lightning_grpo.rollout.hf import HFEngine

    sampling = SamplingConfig(max_new_tokens=8, logprobs=True, seed=0)
    out = HFEngine(model, tok).generate(texts(tok, "12+3=", "45-6=", "7*8="), 4, sampling)
    lines = [json.dumps({"prompt_id": r.prompt.id, "prompt_ids": list(r.prompt.token_ids),
                         "completion_ids": r.token_ids, "reward": 0.0, "logprobs": r.logprobs}) for r in out]
    path.write_text("\n".join(lines) + "\n")


def build(name: str, policy_dir, model, tok, tmp_path):
    """(engine, logprob tolerance) for ``name``."""
    if name == "hf":
        from lightning_grpo.rollout.hf import HFEngine

        return HFEngine(model, tok), 1e-5
    if name == "replay":
        from lightning_grpo.rollout.replay import ReplayEngine

        record(model, tok, tmp_path / "replay.jsonl")
        return ReplayEngine(tmp_path / "replay.jsonl", tok.eos_token_id), 0.0
    pytest.importorskip("vllm")
    if name == "vllm":
        from test_rollout_vllm import CONFIG

        from lightning_grpo.rollout.vllm import VLLMEngine

        return VLLMEngine(policy_dir, CONFIG), 1e-4
    import functools

    from test_rollout_vllm_server import CONFIG

    from lightning_grpo.rollout.vllm_server import VLLMServerEngine

    return VLLMServerEngine(policy_dir, CONFIG, reference=functools.partial(sequence_logprobs, model)), 1e-5


@pytest.fixture(scope="module", params=ENGINES)
def case(request, tiny_policy_dir, tmp_path_factory):
    model, tok = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    engine, atol = build(request.param, tiny_policy_dir, model, tok, tmp_path_factory.mktemp(request.param))
    out = Case(request.param, engine, model, tok, atol)
    out.publish()
    yield out
    if isinstance(engine, Closable):
        engine.close()


def needs_draws(case: Case) -> None:
    if not case.draws:
        pytest.skip("replay draws nothing: it serves recorded completions")


def trainer_logprobs(case: Case, rollout) -> list[float]:
    ids = list(rollout.prompt.token_ids) + list(rollout.token_ids)
    return sequence_logprobs(case.model, ids)[len(rollout.prompt.token_ids) - 1:]


def test_groups_come_back_in_prompt_order(case):
    assert isinstance(case.engine, RolloutEngine)
    out = case.engine.generate(texts(case.tok, "12+3=", "45-6=", "7*8="), 3, SamplingConfig(max_new_tokens=6, seed=0))
    assert [r.prompt.id for r in out] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(1 <= len(r.token_ids) <= 8 for r in out)


def test_prompts_do_not_share_noise(case):
    """Eight copies of one prompt under eight ids: sample j of each copy draws from its own stream, so first tokens
    differ across the copies as much as within a group (a per-sample-index seed would make them equal: vLLM's own
    ``n`` seeds sample j of every prompt with seed + j, so its engines send one request per (prompt id, sample))."""
    needs_draws(case)
    same = case.tok("12+3=")["input_ids"]
    prompts = [Prompt(id=100 + i, token_ids=same) for i in range(8)]
    out = case.engine.generate(prompts, 8, SamplingConfig(max_new_tokens=1, seed=0))
    across, within = first_token_spread(out, 8, 8)
    assert within > 6 and across > within - 1


@pytest.mark.parametrize("top_k", [0, 5])
def test_a_completion_depends_on_its_prompt_id_and_seed_not_on_its_batch(case, top_k):
    a = Prompt(id=3, token_ids=case.tok("12+3=")["input_ids"])
    b = Prompt(id=1, token_ids=case.tok("45-6=")["input_ids"])
    sampling = SamplingConfig(max_new_tokens=8, top_k=top_k, seed=4)
    alone = case.engine.generate([a], 3, sampling)
    beside = case.engine.generate([b, a], 3, sampling)[3:]
    assert [r.token_ids for r in alone] == [r.token_ids for r in beside]


def test_seeded_draws_repeat_and_another_seed_draws_anew(case):
    needs_draws(case)
    prompts = texts(case.tok, "7*8=", "3+4=")
    first = case.engine.generate(prompts, 4, SamplingConfig(max_new_tokens=8, seed=42))
    again = case.engine.generate(prompts, 4, SamplingConfig(max_new_tokens=8, seed=42))
    other = case.engine.generate(prompts, 4, SamplingConfig(max_new_tokens=8, seed=43))
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert [r.token_ids for r in first] != [r.token_ids for r in other]


def test_stop_strings_end_the_completion_with_the_token_that_completes_them(case):
    needs_draws(case)
    greedy = SamplingConfig(max_new_tokens=12, temperature=0.0)
    prompts = texts(case.tok, "3+4=", "(12+34)*56-78=")
    free = case.engine.generate(prompts, 1, greedy)
    full = free[0]
    assert len(full.text) >= 4, "needs a few characters of greedy text to cut"
    stop = full.text[2:4]
    out = case.engine.generate(prompts, 1, SamplingConfig(max_new_tokens=12, temperature=0.0, stop=(stop,)))[0]
    cut = full.text.find(stop)
    assert out.text == full.text[:cut] and out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: cut + 2]  # the char tokenizer: one token per character
    never = case.engine.generate(prompts, 1, SamplingConfig(max_new_tokens=12, temperature=0.0, stop=("#never#",)))
    assert [(r.token_ids, r.text) for r in never] == [(r.token_ids, r.text) for r in free]


def test_sampler_logprobs_are_the_trainers(case):
    case.publish()
    sampling = SamplingConfig(max_new_tokens=8, logprobs=True, seed=7)
    for r in case.engine.generate(texts(case.tok, "12+3=", "45-6="), 4, sampling):
        assert len(r.logprobs) == len(r.token_ids)
        mine = trainer_logprobs(case, r)
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(mine), atol=max(case.atol, 1e-5), rtol=0)


def test_episodes_are_token_in_token_out(case):
    """Multi-turn: each turn continues from token ids, tool results are ids with mask 0, the trained ids are the
    sampled ones and the trainer's logprobs meet the sampler's (test_envs.check_vllm_episodes, for every engine)."""
    needs_draws(case)
    if case.name == "hf":  # at the check's fixed seed this tiny policy's hf draws end no turn (all truncated)
        pytest.skip("hf episodes are played in tests/envs/test_envs.py (a float64 GPT-2 whose turns end)")
    from test_envs import check_vllm_episodes

    from lightning_grpo.tiny.tokenizer import TINY_CHAT_TEMPLATE

    case.publish()
    tok = copy.deepcopy(case.tok)
    tok.chat_template = TINY_CHAT_TEMPLATE  # the runner renders the chat; the engine only ever sees token ids
    check_vllm_episodes(case.engine, tok, case.model)


def test_replay_serves_the_recorded_ids_verbatim(case):
    if case.draws:
        pytest.skip("a drawing engine's token-in token-out is the episode test above")
    records = [json.loads(line) for line in case.engine.path.read_text().splitlines()]
    out = case.engine.generate([Prompt(id=i, token_ids=[]) for i in range(3)], 4, SamplingConfig(seed=9))
    assert [list(r.prompt.token_ids) for r in out] == [rec["prompt_ids"] for rec in records]
    assert [r.token_ids for r in out] == [rec["completion_ids"] for rec in records]


def test_the_next_draw_follows_a_weight_sync(case):
    """Perturb the trainer: an engine with weights of its own is stale until the sync (a skipped sync shows), and
    samples with the new weights after it; the trainer's own weights are put back (and synced) at the end."""
    saved = copy.deepcopy(case.model.state_dict())
    sampling = SamplingConfig(max_new_tokens=8, logprobs=True, seed=3)
    prompts = texts(case.tok, "12+3=")
    try:
        with torch.no_grad():
            for p in case.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        stale = case.engine.generate(prompts, 2, sampling)
        gap = max(abs(a - b) for r in stale for a, b in zip(r.logprobs, trainer_logprobs(case, r)))
        if case.name != "hf":  # the hf engine samples from the trainer's own tensors: never stale
            assert gap > 1e-3
        case.publish()
        for r in case.engine.generate(prompts, 2, sampling):
            follows = max(abs(a - b) for a, b in zip(r.logprobs, trainer_logprobs(case, r)))
            if case.draws:
                assert follows <= max(case.atol, 1e-5)
            else:  # records do not change with the weights
                assert r.logprobs == next(s.logprobs for s in stale if s.token_ids == r.token_ids)
    finally:
        case.model.load_state_dict(saved)
        case.publish()
