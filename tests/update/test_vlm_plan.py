"""Vision-language batches under main's update machinery: fused logprobs, token-budgeted ChunkPlan, DP fillers,
inner epochs. Each chunk still materializes its own pixels only, and every split stays exact."""

import dataclasses
import gc
import weakref

import pytest
import torch
from helpers import image_batch, max_rel_delta, params_of
from test_vlm import SIZES, UNEQUAL, make

from lightning_grpo.data.images import load_images
from lightning_grpo.logprobs import token_logprobs
from lightning_grpo.update.plan import EMPTY, plan_update, sequence_lengths, take

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier


def test_vlm_logprobs_go_through_the_fused_head(tiny_vlm_dir):
    """With pixels, the hidden states come from the VLM's base model and the LM head is applied fused (the head
    module is never called: no [B, T, V] logits), equal to the model's own full-logits forward."""
    module = make(tiny_vlm_dir, "float64")
    batch = image_batch(module, UNEQUAL, SIZES, seed=2)
    vision = module.scorer.materialize(batch)
    inputs = vision.as_kwargs()
    calls = []
    hook = module.policy.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    positions = batch.completion_mask[:, 1:].bool()
    fused = token_logprobs(module.policy, batch.input_ids, batch.attention_mask, positions=positions,
                           model_inputs=inputs)
    assert not calls  # the fused path multiplies by the head's weight itself
    hook.remove()
    logits = module.policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **inputs).logits
    full = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    assert torch.allclose(fused[positions], full[positions], atol=1e-10, rtol=0)
    assert (fused[~positions] == 0).all()
    text_only = token_logprobs(module.policy, batch.input_ids, batch.attention_mask, positions=positions)
    assert (text_only[positions] - fused[positions]).abs().max() > 1e-3  # the pixels matter


def test_budget_cost_counts_expanded_image_tokens(tiny_vlm_dir):
    """A row's token cost holds its image's expanded placeholders; a budget cut on the real cost holds."""
    module = make(tiny_vlm_dir)
    batch = image_batch(module, UNEQUAL, SIZES)
    totals, prompts = sequence_lengths(batch)
    per_image = [module.vision.tokens_per_image(module.vision.process(load_images(refs))[1])[0]
                 for refs in batch.images]  # counted from the pixels, independently of the rows
    assert per_image == [4, 4, 1, 1, 6, 6, 8, 8]
    text = [p - n for p, n in zip(prompts, per_image)]
    assert len(set(text)) == 1  # the same text prompt: rows differ in prompt cost by their image tokens only
    assert totals == [text[0] + n + c for n, c in zip(per_image, UNEQUAL)]
    budget = max(totals)  # tight: two big-image rows never share a chunk
    plan, _ = plan_update(batch, 1, 0, budget=budget)
    for rows in plan.rows[0]:
        assert len(rows) * max(totals[r] for r in rows) <= budget
    assert plan.oversized == 0 and plan.n_chunks(0) > 1


@pytest.mark.parametrize("dtype,tol", [("float64", 5e-8), ("float32", 1e-5)])
def test_filler_chunks_on_an_image_batch_materialize_nothing_and_add_zero(tiny_vlm_dir, dtype, tol, monkeypatch):
    """Under DP a rank with fewer budgeted chunks runs EMPTY fillers: no images there, and the step is unchanged."""
    whole, budgeted = make(tiny_vlm_dir, dtype), make(tiny_vlm_dir, dtype)
    batch = image_batch(whole, UNEQUAL, SIZES, seed=1)
    budget = max(sequence_lengths(batch)[0]) * 2
    fake_dp_max = lambda t: t + torch.tensor([2, 0])  # another rank needed two more chunks; prompt max unchanged
    plans = []

    def plan(b, needs=None):
        plans.append(plan_update(b, 1, 0, budget=budget, dp_max=fake_dp_max))
        return plans[-1]

    monkeypatch.setattr(budgeted.updater, "plan", plan)
    materialized = []
    real = budgeted.vision.materialize
    budgeted.vision.materialize = lambda images, *a, **k: (materialized.append(len(images)), real(images, *a, **k))[1]
    scored = []
    score = budgeted.scorer.logprobs
    monkeypatch.setattr(budgeted.scorer, "logprobs",
                        lambda m, chunk, *a: (scored.append(len(chunk)), score(m, chunk, *a))[1])
    before = params_of(whole.policy)
    whole.updater.update(batch)
    result = budgeted.updater.update(batch)
    train_plan = plans[0][0]
    assert train_plan.empty_chunks == 2 and train_plan.real_chunks >= 2
    fillers = [train_plan.chunk(batch, 0, m) for m in range(train_plan.n_chunks(0)) if train_plan.rows[0][m] == EMPTY]
    assert all(f.images is None and budgeted.scorer.materialize(f) is None for f in fillers)
    assert materialized == [len(rows) for rows in train_plan.rows[0] if rows != EMPTY]  # real chunks only
    assert len(scored) == train_plan.n_chunks(0) and scored[-2:] == [1, 1]  # the fillers ran forward/backward
    assert len(result.chunks) == train_plan.real_chunks and not result.steps[0].skipped  # and reported nothing
    assert max_rel_delta(before, params_of(whole.policy), params_of(budgeted.policy)) <= tol


@pytest.mark.parametrize("train_vision", [False, True], ids=["vision-frozen", "vision-trained"])
def test_a_chunk_without_pixels_still_reaches_every_trainable_parameter(tiny_vlm_dir, train_vision):
    """DDP expects every trainable parameter in the synced backward. A DP filler (or a chunk of text-only rows) never
    runs the vision side, so it ties the merger (and a trained tower) in with a zero term: a zero gradient there,
    the loss and the language model's gradients unchanged."""
    module = make(tiny_vlm_dir, "float64", train_vision=train_vision)
    batch = image_batch(module, UNEQUAL, SIZES)
    trainable = {n: p for n, p in module.policy.named_parameters() if p.requires_grad}
    visual = {n for n in trainable if ".visual." in f".{n}"}
    assert visual and (train_vision or all(".merger." in f".{n}" for n in visual))
    text_only = dataclasses.replace(take(batch, (0, 1, 2)), images=None)
    for chunk in (take(batch, EMPTY), text_only):
        module.policy.zero_grad(set_to_none=True)
        loss, _, _ = module.forward_chunk(chunk, None)
        loss.backward()
        assert not [n for n, p in trainable.items() if p.grad is None]
        assert all(float(trainable[n].grad.abs().max()) == 0 for n in visual)
    plain_loss, _, _ = module.objective.chunk_loss(text_only.to(module.device), module.scorer.policy_view(), None)
    assert float(loss) == float(plain_loss)


@pytest.mark.parametrize("budget", [0, 1], ids=["fixed", "budgeted"])
def test_inner_epochs_rematerialize_one_chunk_at_a_time(tiny_vlm_dir, budget):
    """mu_iterations=2 over n_mini=2 (ahead pass + replayed pi_old), fixed or token-budgeted chunks: every scoring
    materializes its own chunk's pixels while no earlier chunk's pixel tensor is alive."""
    module = make(tiny_vlm_dir, mini=4, micro=0 if budget else 2, train_vision=True, mu_iterations=2)
    batch = image_batch(module, UNEQUAL, SIZES)
    if budget:
        module.rl.max_tokens_per_micro = max(sequence_lengths(batch)[0]) * 2
    alive: list[weakref.ref] = []
    counts: list[int] = []
    real = module.vision.materialize

    def materialize(*args, **kwargs):
        counts.append(sum(r() is not None for r in alive))
        inputs = real(*args, **kwargs)
        alive.append(weakref.ref(inputs.pixel_values))
        return inputs

    module.vision.materialize = materialize
    result = module.updater.update(batch)
    plan = module.updater.last_plan
    assert plan.mu_iterations == 2 and len(result.steps) == 4 and not any(s.skipped for s in result.steps)
    real_chunks = plan.real_chunks
    # ahead pass scores mini-batch 1 (and 0 for the later epoch's replay when it needs one), training scores every
    # chunk of both epochs: at least 2 x the chunks of one epoch, each with its own pixels.
    assert len(counts) >= 2 * real_chunks, (counts, real_chunks)
    assert counts == [0] * len(counts), counts
    gc.collect()
    assert all(r() is None for r in alive)


def test_a_lora_adapter_on_a_vlm_scores_the_images_and_chunks_exactly(tiny_vlm_dir):
    """policy.lora on a VLM: the fused path finds the VLM's base model under peft's wrapper, only the adapter
    trains (not in the frozen vision encoder), and n_micro 2 equals the unchunked step."""
    from lightning_grpo.config import GRPOConfig, RolloutConfig
    from lightning_grpo.lora import LoraConfig
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.policy import PolicyConfig

    def lora_module(micro):
        rl = GRPOConfig(batch_per_replica=8, group_size=2, micro_batch_per_replica=micro, max_grad_norm=0.0)
        policy = PolicyConfig(path=str(tiny_vlm_dir), dtype="float64", lora=LoraConfig(rank=4, alpha=8))
        module = GRPOModule(policy=policy, rl=rl, rollout=RolloutConfig())
        module.configure_model()
        params = [p for p in module.policy.parameters() if p.requires_grad]
        module.updater.attach(torch.optim.SGD(params, lr=0.5), split=module.split())  # the budget set above
        return module

    whole, chunked = lora_module(0), lora_module(4)
    batch = image_batch(whole, UNEQUAL, SIZES, seed=1)
    before = params_of(whole.policy)
    whole.updater.update(batch)
    whole.updater.update(batch)  # a second step: lora_B has moved, so lora_A gets gradient and the images matter through both
    chunked.updater.update(batch)
    chunked.updater.update(batch)
    after = params_of(chunked.policy)
    moved = {k for k, v in after.items() if not torch.equal(v, before[k])}
    assert moved and all("lora_" in k for k in moved)
    # policy.train_vision_tower=false holds under peft too: the encoder's adapters stay frozen, the merger's train
    trainable = [n for n, p in chunked.policy.named_parameters() if p.requires_grad]
    assert not any(".visual.blocks." in n for n in trainable) and any(".visual.merger." in n for n in moved)
    assert max_rel_delta(before, params_of(whole.policy), after) <= 5e-8


@pytest.mark.heavy  # a 2-rank launch: CI and `make test-integration`
def test_two_ranks_train_a_vlm_whose_last_chunk_on_one_rank_is_a_filler(tmp_path, tiny_vlm_dir):
    """2 gloo ranks, 2 loop steps, vision tower trained: rank 1's synced (last) chunk is a DP filler without pixels.
    DDP needs the vision parameters in that backward; FSDP2 shards the decoder layers and keeps the vision tower in
    the root group (sharded on its own, its blocks all-gathered on rank 0 only: a gloo size mismatch). Both ranks
    end with one and the same model, and FSDP2 with the model DDP trains."""
    import dist_worker as W
    from test_distributed import launch_two_ranks

    cases = ["ddp-vlm-steps2", "fsdp2-vlm-steps2"]
    launch_two_ranks(tmp_path, tiny_vlm_dir, cases)
    runs = {}
    for case in cases:
        r0, r1 = runs[case] = [torch.load(tmp_path / f"{case}.rank{r}.pt", weights_only=False) for r in (0, 1)]
        assert r0["sharded"] == case.startswith("fsdp2")
        assert len(r0["chunks"][0]) == 2 and EMPTY not in r0["chunks"][0]  # rank 0: two real chunks
        assert r1["chunks"][0][-1] == EMPTY and EMPTY not in r1["chunks"][0][:-1]  # rank 1: one, then the filler
        assert r0["metrics"]["grpo/n"] == len(W.VLM_LENGTHS)
        visual = [k for k in r0["params"] if ".visual." in f".{k}"]
        assert visual and all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])
    before = params_of(make(tiny_vlm_dir, train_vision=True).policy)
    ddp, fsdp2 = runs["ddp-vlm-steps2"][0]["params"], runs["fsdp2-vlm-steps2"][0]["params"]
    assert max_rel_delta(before, ddp, fsdp2) <= 1e-5
    assert any(not torch.equal(before[k], ddp[k]) for k in visual)  # the tower trained
