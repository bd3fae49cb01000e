"""HFEngine: batched transformers generate on the policy itself."""

from __future__ import annotations

import pytest
import torch

from lightning_grpo.policy import PolicyConfig, load_policy
from lightning_grpo.rollout.base import Prompt, RolloutEngine, SamplingConfig
from lightning_grpo.rollout.hf import HFEngine

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier


@pytest.fixture
def policy(tiny_policy_dir):
    return load_policy(PolicyConfig(path=str(tiny_policy_dir)))


@pytest.fixture
def engine(policy):
    return HFEngine(*policy)


def prompts_of(tok, texts: list[str]) -> list[Prompt]:
    return [Prompt(id=i, token_ids=tok(t)["input_ids"], text=t) for i, t in enumerate(texts)]


def rescore(model, rollout, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of the completion tokens, from an unpadded forward."""
    prompt, completion = rollout.prompt.token_ids, rollout.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float() / temperature
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [C, V]
    return lp.gather(1, torch.tensor(completion)[:, None])[:, 0]


def test_protocol_shapes_and_grouping(engine, policy):
    _, tok = policy
    assert isinstance(engine, RolloutEngine)
    out = engine.generate(prompts_of(tok, ["12+3=", "1+1=", "7*8="]), 3, SamplingConfig(max_new_tokens=6, seed=0))
    assert [r.prompt.id for r in out] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for r in out:
        assert 1 <= len(r.token_ids) <= 6 and r.logprobs is None
        assert r.text == tok.decode(r.token_ids, skip_special_tokens=True)


def test_left_padding_gives_the_same_greedy_tokens(engine, policy):
    _, tok = policy
    greedy = SamplingConfig(max_new_tokens=12, temperature=0.0)
    alone = engine.generate(prompts_of(tok, ["3+4="]), 1, greedy)[0]
    batch = engine.generate(prompts_of(tok, ["(12+34)*56-78=", "3+4=", "9*9*9*9="]), 2, greedy)
    assert batch[2].token_ids == batch[3].token_ids == alone.token_ids


def test_grouped_decode_draws_the_same_tokens_and_logprobs(policy, monkeypatch):
    """Decoding the grouped-query policy (2 query heads per KV head) without copying its KV heads (rollout/gqa.py)
    changes nothing: on left-padded prompts (a padding mask at every decode step) the same seeds draw the same tokens
    with bit-identical sampler logprobs as transformers' sdpa path. It really ran (calls counted, masked ones among
    them), and the model is back on its own attention afterwards."""
    from lightning_grpo.rollout import gqa

    model, tok = policy
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    calls = {"masked": 0, "all": 0}

    def counted(module, query, key, value, attention_mask, **kw):
        calls["all"] += 1
        calls["masked"] += attention_mask is not None
        return grouped(module, query, key, value, attention_mask, **kw)

    grouped = gqa._grouped_sdpa
    monkeypatch.setattr(gqa, "_grouped_sdpa", counted)
    prompts = prompts_of(tok, ["(12+34)*56-78=", "3+4=", "9*9="])
    sampling = SamplingConfig(max_new_tokens=16, temperature=1.0, logprobs=True, seed=3)
    copied = HFEngine(model, tok, grouped_attention=False).generate(prompts, 4, sampling)
    assert calls["all"] == 0
    fast = HFEngine(model, tok).generate(prompts, 4, sampling)
    assert calls["masked"] > 0 and model.config._attn_implementation == "sdpa"
    assert [r.token_ids for r in fast] == [r.token_ids for r in copied]
    assert [r.logprobs for r in fast] == [r.logprobs for r in copied]


def test_grouped_decode_leaves_other_policies_alone(policy):
    """Only a CPU sdpa policy with grouped KV heads switches: eager attention, or one KV head per query head, keeps
    the model's own attention (nothing to save)."""
    from lightning_grpo.rollout.gqa import applies

    model, _ = policy
    assert applies(model)
    model.config._attn_implementation = "eager"
    assert not applies(model)
    model.config._attn_implementation = "sdpa"
    model.config.num_key_value_heads = model.config.num_attention_heads
    assert not applies(model)


def test_eos_ends_the_completion_and_is_kept(policy):
    model, tok = policy
    greedy = SamplingConfig(max_new_tokens=10, temperature=0.0)
    first = HFEngine(model, tok).generate(prompts_of(tok, ["3+4="]), 1, greedy)[0].token_ids[0]
    engine = HFEngine(model, tok, eos_token_ids=[first])  # the greedy first token now ends the completion
    out = engine.generate(prompts_of(tok, ["3+4=", "(12+34)*56-78=", "x"]), 2, greedy)
    assert out[0].token_ids == [first] and out[0].finish_reason == "stop"
    for r in out:  # whatever the row: EOS only last, 'stop' iff it ended on EOS, 'length' iff it used the cap
        assert first not in r.token_ids[:-1]
        assert (r.finish_reason == "stop") == (r.token_ids[-1] == first)
        assert (r.finish_reason == "length") == (len(r.token_ids) == 10 and r.token_ids[-1] != first)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_rescore_at_the_sampling_temperature(engine, policy, temperature):
    model, tok = policy
    sampling = SamplingConfig(max_new_tokens=10, temperature=temperature, logprobs=True, seed=3)
    out = engine.generate(prompts_of(tok, ["12+3=", "(1+2)*3-4="]), 4, sampling)
    for r in out:
        assert len(r.logprobs) == len(r.token_ids)
        torch.testing.assert_close(torch.tensor(r.logprobs), rescore(model, r, temperature), atol=1e-5, rtol=0)


def test_sampler_logprobs_equal_what_the_update_scores(engine, policy):
    """The sampler's logprobs against the fused scorer the update uses, on the packed batch (right-padded, one
    forward for all rows): equal at every completion token, so rollout logprobs can stand in for pi_old."""
    from lightning_grpo.batch import pack_rollouts
    from lightning_grpo.logprobs import token_logprobs

    model, tok = policy
    sampling = SamplingConfig(max_new_tokens=10, temperature=0.8, logprobs=True, seed=5)
    out = engine.generate(prompts_of(tok, ["12+3=", "(1+2)*3-4=", "7*8="]), 4, sampling)
    batch = pack_rollouts(out, torch.zeros(len(out)), torch.zeros(len(out)), tok.pad_token_id)
    mask = batch.completion_mask[:, 1:]
    with torch.no_grad():
        scored = token_logprobs(model, batch.input_ids, batch.attention_mask, positions=mask, temperature=0.8)
    torch.testing.assert_close(scored[mask], batch.rollout_logprobs[:, 1:][mask], atol=1e-5, rtol=0)


def test_top_p_logprobs_are_renormalized_over_the_nucleus(engine, policy):
    model, tok = policy
    out = engine.generate(
        prompts_of(tok, ["12+3="]), 4, SamplingConfig(max_new_tokens=8, top_p=0.5, logprobs=True, seed=0)
    )
    got = torch.tensor([lp for r in out for lp in r.logprobs])
    full = torch.cat([rescore(model, r) for r in out])
    assert (got >= full - 1e-6).all() and (got > full + 1e-3).any()


def test_seeded_draws_repeat_and_leave_the_global_rng_alone(engine, policy):
    _, tok = policy
    prompts = prompts_of(tok, ["12+3=", "1+1="])
    state = torch.get_rng_state()
    a = engine.generate(prompts, 3, SamplingConfig(max_new_tokens=8, logprobs=True, seed=11))
    b = engine.generate(prompts, 3, SamplingConfig(max_new_tokens=8, logprobs=True, seed=11))
    c = engine.generate(prompts, 3, SamplingConfig(max_new_tokens=8, logprobs=True, seed=12))
    assert torch.equal(torch.get_rng_state(), state)
    assert [r.token_ids for r in a] == [r.token_ids for r in b] and [r.logprobs for r in a] == [r.logprobs for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


def test_top_k_logprobs_are_renormalized_over_the_k_kept_tokens(engine, policy):
    model, tok = policy
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.9, top_k=3, logprobs=True, seed=0)
    for r in engine.generate(prompts_of(tok, ["12+3="]), 4, sampling):
        with torch.no_grad():
            logits = model(torch.tensor([r.prompt.token_ids + r.token_ids])).logits[0].float() / 0.9
        steps = logits[len(r.prompt.token_ids) - 1 : -1]  # [C, V]
        kept = steps.topk(3, -1).indices
        assert all(t in k for t, k in zip(r.token_ids, kept.tolist()))  # only the 3 most likely are ever drawn
        cut = torch.full_like(steps, float("-inf")).scatter(1, kept, steps.gather(1, kept))
        expected = torch.log_softmax(cut, -1).gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), expected, atol=1e-5, rtol=0)


def test_checkpoint_generation_config_does_not_leak_into_the_draw(engine, policy):
    model, tok = policy
    prompts = prompts_of(tok, ["12+3="])
    sampling = SamplingConfig(max_new_tokens=8, seed=5)
    plain = engine.generate(prompts, 4, sampling)
    model.generation_config.top_k, model.generation_config.repetition_penalty = 1, 3.0
    assert [r.token_ids for r in engine.generate(prompts, 4, sampling)] == [r.token_ids for r in plain]
    assert model.generation_config.top_k == 1  # restored after the call


@pytest.mark.parametrize("training", [True, False])
def test_generates_with_the_policy_itself_and_restores_its_mode(policy, training):
    model, tok = policy
    model.train(training)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    engine = HFEngine(model, tok)
    engine.generate(prompts_of(tok, ["1+1="]), 2, SamplingConfig(max_new_tokens=4, seed=0))
    assert engine.model is model and model.training is training
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    assert all(p.grad is None and p.requires_grad for p in model.parameters())


def test_load_weights_skips_own_tensors_and_copies_foreign_ones(engine, policy):
    model, _ = policy
    norm = model.get_parameter("model.norm.weight")
    ptr = norm.data_ptr()
    engine.load_weights(model.named_parameters())  # its own tensors: nothing to do
    engine.load_weights([("model.norm.weight", torch.full_like(norm, 0.5, dtype=torch.float64))])
    assert norm.data_ptr() == ptr and torch.equal(norm, torch.full_like(norm, 0.5))
    with pytest.raises(ValueError, match="no parameter or buffer named 'model.nope'"):
        engine.load_weights([("model.nope", norm)])


def test_sleep_and_wake_are_idempotent_and_guard_generation(engine, policy):
    _, tok = policy
    prompts, sampling = prompts_of(tok, ["1+1="]), SamplingConfig(max_new_tokens=2, seed=0)
    engine.sleep()
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, 1, sampling)
    engine.wake_up(["weights"])
    engine.reset_prefix_cache()
    assert engine.asleep == {"kv_cache"}
    engine.wake_up(["kv_cache"])
    engine.wake_up()
    assert engine.asleep == frozenset() and len(engine.generate(prompts, 1, sampling)) == 1
    with pytest.raises(ValueError, match="unknown tags"):
        engine.wake_up(["kv"])


def test_a_prompt_longer_than_the_context_is_refused(engine, policy):
    model, _ = policy
    n_ctx = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"prompt id=7: {n_ctx} prompt tokens"):
        engine.generate([Prompt(id=7, token_ids=[5] * n_ctx)], 1, SamplingConfig(max_new_tokens=4))


def test_cut_at_stop_keeps_the_completing_token_and_cuts_the_text():
    from lightning_grpo.rollout.base import cut_at_stop

    decode = lambda ids: "".join(chr(96 + i) for i in ids)  # noqa: E731 - 1 -> "a", 2 -> "b", ...
    assert cut_at_stop([1, 2, 3, 4, 5], ["cd"], decode) == ([1, 2, 3, 4], "ab", True)
    assert cut_at_stop([1, 2, 3, 4, 5], ["zz"], decode) == ([1, 2, 3, 4, 5], "abcde", False)
    assert cut_at_stop([1, 2, 3, 4, 5], ["e", "bc"], decode) == ([1, 2, 3], "a", True)  # the first to complete


def test_stop_strings_end_the_completion(engine, policy):
    _, tok = policy
    greedy = SamplingConfig(max_new_tokens=12, temperature=0.0)
    prompts = prompts_of(tok, ["3+4=", "(12+34)*56-78="])
    free = engine.generate(prompts, 1, greedy)
    full = free[0]
    assert len(full.text) >= 4, "needs a few characters of greedy text to cut"
    stop = full.text[2:4]
    out = engine.generate(prompts, 1, SamplingConfig(max_new_tokens=12, temperature=0.0, stop=(stop,)))[0]
    cut = full.text.find(stop)
    assert out.text == full.text[:cut] and out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: cut + 2]  # up to the token that completed the stop string
    # a stop string that never occurs changes nothing
    same = engine.generate(prompts, 1, SamplingConfig(max_new_tokens=12, temperature=0.0, stop=("#never#",)))
    assert [(r.token_ids, r.text, r.finish_reason) for r in same] == [(r.token_ids, r.text, r.finish_reason)
                                                                       for r in free]
