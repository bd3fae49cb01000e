"""Padding-free packed chunks (``packing.py``): equal to the padded path, never attending across rows, refused where
inexact."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import max_rel_delta, params_of, synthetic_batch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from lightning_grpo import packing
from lightning_grpo.config import ConfigError, GRPOConfig, RolloutConfig
from lightning_grpo.logprobs import token_logprobs
from lightning_grpo.module import GRPOModule
from lightning_grpo.objectives.base import PolicyView
from lightning_grpo.objectives.grpo import GRPOObjective
from lightning_grpo.packing import ATTENTION, Packing, PackingError, pack, packed_attention
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.update import AheadPass, Needs, Split, Updater
from lightning_grpo.update.plan import token_chunks

LONG_TAIL = [3, 30, 1, 2, 5, 0, 4, 26]  # two long completions among short ones (and an empty one)


@pytest.fixture(scope="module")
def gpt2_float64_dir(tmp_path_factory):
    """A tiny GPT-2, float64 end to end (no float32 upcast inside, unlike Qwen2's RMSNorm)."""
    path = tmp_path_factory.mktemp("gpt2-float64-packing")
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=80, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, torch_dtype="float64")
    torch.manual_seed(0)
    GPT2LMHeadModel(config).double().save_pretrained(path)
    return path


def scores(model, batch, packed):
    return token_logprobs(model, batch.input_ids, batch.attention_mask, positions=batch.completion_mask[:, 1:],
                          packed=packed)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


# -- layout --------------------------------------------------------------------------------------------------------
def test_pack_lays_rows_end_to_end_with_restarting_positions():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    mask = ids != 0
    mask[2] = True
    rows = pack(ids, mask)
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert rows.cu_seq_lens.tolist() == [0, 3, 5, 9] and rows.max_length == 4
    hidden = torch.arange(9.0)[None, :, None]  # [1, R, 1]: each packed token's own index
    picked = rows.gather(hidden, torch.tensor([[False, True, True], [True, False, False], [False, False, True]]))
    assert picked[:, 0].tolist() == [1.0, 2.0, 3.0, 7.0]  # (0,1) (0,2) (1,0) (2,2) in row-major order


def test_pack_refuses_left_padding_and_scored_padding():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    with pytest.raises(PackingError, match="right-padded"):
        pack(ids, ids != 0)
    rows = pack(torch.tensor([[5, 6, 0]]), torch.tensor([[True, True, False]]))
    with pytest.raises(PackingError, match="padding"):
        rows.gather(torch.zeros(1, 2, 4), torch.tensor([[False, False, True]]))  # the hidden state of the pad token


# -- exactness: values and gradients -------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen2-float32", "gpt2-float64"])
def test_packed_logprobs_and_gradients_equal_padded(tiny_policy_dir, gpt2_float64_dir, arch):
    path, dtype, tol = ((tiny_policy_dir, torch.float32, 1e-6) if arch == "qwen2-float32"
                        else (gpt2_float64_dir, torch.float64, 5e-8))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).train()
    batch = synthetic_batch(LONG_TAIL, seed=2)
    weights = torch.randn(batch.input_ids[:, 1:].shape, dtype=dtype, generator=torch.Generator().manual_seed(0))
    grads = {}
    for packed in (False, True):
        model.zero_grad()
        lp = scores(model, batch, packed)
        (lp * weights).sum().backward()
        grads[packed] = (lp.detach(), [p.grad.clone() for p in model.parameters()])
    assert rel(grads[False][0], grads[True][0]) <= tol
    assert max(rel(a, b) for a, b in zip(grads[False][1], grads[True][1])) <= tol
    assert (grads[True][0][~batch.completion_mask[:, 1:]] == 0).all()  # unscored positions read 0, as padded


def gpt2_updater(path, split: Split, obj: GRPOObjective, needs: Needs) -> Updater:
    """The real update path (Updater, ahead pass, GRPO objective) over the float64 GPT-2, scored packed or not."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).train()
    score = lambda c: scores(model, c, split.packed)
    view = PolicyView(model=model, temperature=1.0, logprobs=score, reference=None, call=lambda fn, *a: fn(*a))
    updater = Updater(model, lambda chunk, old: obj.chunk_loss(chunk, view, old), split, needs,
                      ahead=AheadPass(model, score))
    updater.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    return updater


def test_packed_update_equals_padded_update_in_float64(gpt2_float64_dir):
    """Two inner epochs against a frozen pi_old (the ratio departs from 1 and clips): padded whole, packed whole and
    packed under a real-token budget (several chunks) take the same steps to float64 rounding."""
    batch = synthetic_batch(LONG_TAIL, seed=1)
    obj = GRPOObjective(0.01, 0.01, max_completion_length=32)
    arms = {"padded": Split(rows=8, mu_iterations=2), "packed": Split(rows=8, mu_iterations=2, packed=True),
            "packed-budget": Split(rows=8, mu_iterations=2, packed=True, max_tokens_per_micro=40)}
    runs = {name: gpt2_updater(gpt2_float64_dir, split, obj, Needs(pi_old=True)) for name, split in arms.items()}
    before = params_of(runs["padded"].policy)
    for u in runs.values():
        u.update(batch)
    assert runs["packed-budget"].last_plan.real_chunks > 1
    for name in ("packed", "packed-budget"):
        assert max_rel_delta(before, params_of(runs["padded"].policy), params_of(runs[name].policy)) <= 5e-8


def grpo_module(policy_dir, packed, budget=0):
    rl = GRPOConfig(batch_per_replica=8, group_size=2, max_tokens_per_micro=budget, max_grad_norm=0.0, packed=packed)
    module = GRPOModule(policy=PolicyConfig(path=str(policy_dir)), rl=rl, rollout=RolloutConfig())
    module.configure_model()
    module.updater.attach(torch.optim.SGD(module.policy.parameters(), lr=0.1))
    return module


def test_packed_module_step_equals_padded_in_float32_and_keeps_one_chunk_bit_identical(tiny_policy_dir):
    """GRPOModule end to end on the tiny Qwen2 (float32): packed (auto: packed on CPU) == padded to 1e-6 relative;
    packing is opt-in (rl.packed defaults to false).
    The n_micro == 1 contract: a packed window of one chunk takes the plain loss's backward (no deferred divisor), so
    it is bit-identical to the packed unchunked step; packed and padded differ only by rounding."""
    batch = synthetic_batch(LONG_TAIL, seed=1)
    runs = {"padded": grpo_module(tiny_policy_dir, False), "auto": grpo_module(tiny_policy_dir, "auto"),
            "one-chunk": grpo_module(tiny_policy_dir, True, budget=10_000),
            "chunked": grpo_module(tiny_policy_dir, True, budget=40)}
    assert runs["auto"].scorer.packed and not runs["padded"].scorer.packed and GRPOConfig().packed is False
    before = params_of(runs["padded"].policy)
    for module in runs.values():
        module.updater.update(batch)
    padded = params_of(runs["padded"].policy)
    assert runs["one-chunk"].updater.last_plan.real_chunks == 1 and runs["chunked"].updater.last_plan.real_chunks > 1
    assert max_rel_delta(before, padded, params_of(runs["auto"].policy)) <= 1e-6
    assert max_rel_delta(before, padded, params_of(runs["chunked"].policy)) <= 1e-5  # chunking's own fp32 rounding
    assert max_rel_delta(before, params_of(runs["auto"].policy), params_of(runs["one-chunk"].policy)) == 0.0


def test_a_real_token_budget_packs_more_rows_per_chunk():
    lengths = [30, 10, 10, 10]
    assert len(token_chunks(lengths, range(4), 60)) == 2  # padded: 30 + 3 x 10 rows pay 4 x 30 = 120
    assert token_chunks(lengths, range(4), 60, packed=True) == [(0, 1, 2, 3)]  # packed: 60 real tokens


# -- rows never see each other -------------------------------------------------------------------------------------
def leaky_attention(module, query, key, value, attention_mask, **kwargs):
    """Causal attention over the whole packed sequence: what an implementation that ignored row boundaries does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, dropout=kwargs.get("dropout", 0.0),
                                  scaling=kwargs.get("scaling"))


def second_row_moves(model, batch) -> float:
    """How much row 1's packed logprobs move when row 0's tokens change (0: row 1 never saw row 0)."""
    other = batch.input_ids.clone()
    other[0] = torch.where(batch.attention_mask[0], (other[0] + 7) % 80, other[0])
    with torch.no_grad():
        a = scores(model, batch, True)[1]
        b = token_logprobs(model, other, batch.attention_mask, positions=batch.completion_mask[:, 1:], packed=True)[1]
    return float((a - b).abs().max())


def test_cross_row_attention_would_be_caught(tiny_policy_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir).eval()
    batch = synthetic_batch([6, 8], seed=3)
    assert second_row_moves(model, batch) == 0.0  # packed: row 1 is blind to row 0, bit for bit
    monkeypatch.setattr(packing, "_row_attention", leaky_attention)  # what a boundary-blind attention would do
    assert second_row_moves(model, batch) > 1e-3  # the sentinel sees it


def test_row_attention_refuses_a_call_without_boundaries(tiny_policy_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir)
    ids = torch.tensor([[5, 6, 7]])
    with packed_attention(model), pytest.raises(PackingError, match="attend across rows"):
        model(input_ids=ids)  # a packed-attention forward that lost its cu_seq_lens
    assert model.config._attn_implementation == "sdpa"  # restored


# -- refused where inexact -----------------------------------------------------------------------------------------
def llama(**config):
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      **config)
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("case,match", [
    ("flex", "'flex_attention'"), ("vision", "vision-language"), ("routing", "routing replay"),
    ("softcap", "after the LM head"), ("window", "sliding_window"),
])
def test_packing_is_refused_where_inexact_and_falls_back_under_auto(case, match, caplog):
    model, kw = llama(), {}
    if case == "flex":
        model.config._attn_implementation = "flex_attention"
    elif case == "window":
        model.config.sliding_window = 16
    else:
        kw = {"vision": True} if case == "vision" else {"routing": True} if case == "routing" else {"linear_head": False}
    assert Packing.resolve(True, llama()).on("cpu")  # the plain model packs
    with pytest.raises(PackingError, match=match):
        Packing.resolve(True, model, **kw)
    with caplog.at_level(logging.WARNING, logger="lightning_grpo.packing"):
        auto = Packing.resolve("auto", model, **kw)
    assert not auto.on("cpu") and len(caplog.records) == 1 and match.strip("'") in caplog.records[0].getMessage()


def test_auto_packs_on_cpu_only_and_false_never():
    model = llama()
    assert Packing.resolve("auto", model).on("cpu") and not Packing.resolve("auto", model).on("cuda")
    assert Packing.resolve(True, model).on("cuda") and not Packing.resolve(False, model).on("cpu")
    with pytest.raises(ConfigError, match="packed='yes'"):
        GRPOConfig(packed="yes")
    assert ATTENTION not in ("sdpa", "eager")
