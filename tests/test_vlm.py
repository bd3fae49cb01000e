"""Vision-language policies: exact chunking with images, per-chunk pixels, the divisor, the vision tower, engines."""

import gc
import weakref
from dataclasses import replace

import pytest
import torch
from helpers import image_batch, max_rel_delta, params_of, png

from lightning_grpo.config import GRPOConfig, RolloutConfig
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.vision import vision_tower

UNEQUAL = [1, 12, 3, 20, 2, 7, 15, 4]  # completion lengths of 4 prompts x 2
SIZES = [(56, 56), (28, 28), (84, 56), (56, 112)]  # 4, 1, 6 and 8 image tokens: prompt lengths differ too


def make(policy_dir, dtype="float32", micro=0, mini=0, train_vision=False, beta=0.0, batch=8, **rl_fields):
    rl = GRPOConfig(batch_per_replica=batch, group_size=2, mini_batch_per_replica=mini,
                    micro_batch_per_replica=micro, max_grad_norm=0.0, beta=beta, **rl_fields)
    policy = PolicyConfig(path=str(policy_dir), dtype=dtype, train_vision_tower=train_vision)
    module = GRPOModule(policy=policy, rl=rl, rollout=RolloutConfig())
    module.configure_model()  # no Trainer: build the policy ourselves
    module.updater.attach(torch.optim.SGD([p for p in module.policy.parameters() if p.requires_grad], lr=0.1))
    return module


@pytest.mark.parametrize("train_vision", [False, True], ids=["vision-frozen", "vision-trained"])
@pytest.mark.parametrize("dtype,tol", [("float64", 5e-8), ("float32", 1e-5)])
@pytest.mark.parametrize("n_micro", [2, 4])
def test_chunked_step_equals_unchunked_on_image_batch(tiny_vlm_dir, dtype, tol, n_micro, train_vision):
    whole = make(tiny_vlm_dir, dtype, train_vision=train_vision)
    chunked = make(tiny_vlm_dir, dtype, micro=8 // n_micro, train_vision=train_vision)
    batch = image_batch(whole, UNEQUAL, SIZES, seed=1)
    before = params_of(whole.policy)
    whole.updater.update(batch)
    result = chunked.updater.update(batch)
    assert len(result.steps) == 1 and not result.steps[0].skipped
    assert max_rel_delta(before, params_of(whole.policy), params_of(chunked.policy)) <= tol
    tower = {f"model.visual.{k}" for k, _ in vision_tower(whole.policy).named_parameters()}
    moved = {k for k, v in params_of(chunked.policy).items() if not torch.equal(v, before[k])}
    assert ("model.visual.patch_embed.proj.weight" in moved) == train_vision  # the tower trains only when asked
    assert any(k.startswith("model.visual.merger.") for k in moved) and moved - tower  # merger + LM always


def test_images_reach_the_update(tiny_vlm_dir):
    """The same tokens with other pixels give another update: the images are really scored, not just placeholders."""
    a, b = make(tiny_vlm_dir, "float64"), make(tiny_vlm_dir, "float64")
    batch = image_batch(a, UNEQUAL, SIZES, seed=1)
    recolored = tuple((png(SIZES[(i // 2) % 4], color=(20, 20, 220)),) for i in range(8))  # same sizes, other pixels
    before = params_of(a.policy)
    a.updater.update(batch)
    b.updater.update(replace(batch, images=recolored))
    assert max_rel_delta(before, params_of(a.policy), params_of(b.policy)) > 1e-3


def test_divisor_counts_completion_tokens_only(tiny_vlm_dir):
    module = make(tiny_vlm_dir, micro=2)
    batch = image_batch(module, UNEQUAL, SIZES)
    image_tokens = int((batch.input_ids == module.vision.image_token_id).sum())
    assert image_tokens == 2 * (4 + 1 + 6 + 8)  # every prompt's expanded placeholders, in the rows
    result = module.updater.update(batch)
    denom = sum(float(s.denom) for s in result.chunks)
    assert denom == sum(UNEQUAL) == int(batch.completion_mask.sum())  # image placeholders never count
    assert not (batch.completion_mask & (batch.input_ids == module.vision.image_token_id)).any()


def test_only_one_chunks_pixels_are_alive(tiny_vlm_dir):
    """The batch holds references only; each chunk's pixels are made when it is scored and gone before the next.

    n_mini=2 x n_micro=2 with the ahead pass (mini-batch 1 re-materialized there too) and a reference model."""
    module = make(tiny_vlm_dir, mini=4, micro=2, train_vision=True, beta=0.1)
    batch = image_batch(module, UNEQUAL, SIZES)
    assert not any(isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() == 2 and v.shape[0] > 8
                   for v in vars(batch).values())  # rows x features only: no pixel tensor rides along
    alive: list[weakref.ref] = []
    counts: list[int] = []
    real = module.vision.materialize

    def materialize(*args, **kwargs):
        counts.append(sum(r() is not None for r in alive))  # pixel tensors of earlier chunks still alive
        inputs = real(*args, **kwargs)
        alive.append(weakref.ref(inputs.pixel_values))
        return inputs

    module.vision.materialize = materialize
    module.updater.update(batch)
    # ahead pass: mini 1's two chunks (mini 0 is scored in training: the probe's chunk is scored twice there);
    # training: 4 chunks, each scored once for the policy and the reference with one materialization.
    assert len(counts) >= 6, counts
    assert counts == [0] * len(counts), counts
    gc.collect()
    assert all(r() is None for r in alive)


def test_ahead_pass_pairs_chunks_with_their_own_images(tiny_vlm_dir):
    """n_mini=2: pi_old of each chunk is that chunk's own eval-mode logprobs (its images re-materialized)."""
    module = make(tiny_vlm_dir, "float64", mini=4, micro=2)
    batch = image_batch(module, UNEQUAL, SIZES, seed=3)
    from lightning_grpo.update.plan import ChunkPlan

    plan = ChunkPlan.fixed(len(batch), 2, 2)
    pi_old = module.updater.ahead.compute(batch, plan, module.updater.needs)
    for k, (mini, micro) in enumerate(plan.walk()):
        if pi_old[k] is None:
            continue  # mini-batch 0 trains before any step: its pi_old is its own detached logprobs
        chunk = plan.chunk(batch, mini, micro)
        with torch.no_grad():
            module.policy.eval()
            expected = module.scorer.logprobs(module.policy, chunk)
            module.policy.train()
        assert torch.equal(pi_old[k], expected)
    assert any(p is not None for p in pi_old)


def test_vision_tower_frozen_by_default_merger_trains(tiny_vlm_dir):
    frozen, trained = make(tiny_vlm_dir), make(tiny_vlm_dir, train_vision=True)
    tower = vision_tower(frozen.policy)
    assert not tower.patch_embed.proj.weight.requires_grad and not any(
        p.requires_grad for n, p in tower.named_parameters() if not n.startswith("merger."))
    assert all(p.requires_grad for p in tower.merger.parameters())
    assert all(p.requires_grad for p in trained.policy.parameters())
    n_opt = sum(p.numel() for g in frozen.updater.loop.accumulator.optimizer.param_groups for p in g["params"])
    assert n_opt < sum(p.numel() for p in frozen.policy.parameters())  # the frozen tower is not optimized


def test_hf_engine_generates_from_images(tiny_vlm_dir):
    """transformers generate with images: the completion depends on the pixels, and the rollout tokens are the
    expanded prompt (the update scores exactly what the engine saw)."""
    from lightning_grpo.collect.prompts import step_prompts
    from lightning_grpo.data.images import with_image_parts
    from lightning_grpo.data.prompts import PromptRecord
    from lightning_grpo.rollout.base import SamplingConfig
    from lightning_grpo.rollout.hf import HFEngine

    module = make(tiny_vlm_dir)
    engine = HFEngine(module.policy, module.tokenizer, vision=module.vision)
    records = [PromptRecord(i, "what?", None, {}, with_image_parts("what?", 1), (png(s, color=c, seed=i),))
               for i, (s, c) in enumerate([((56, 56), (250, 0, 0)), ((28, 56), (0, 0, 250))])]
    prompts, _ = step_prompts(records, module.tokenizer, module.vision)
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0, logprobs=True)
    rollouts = engine.generate(prompts, 2, greedy)
    assert [len(r.prompt.token_ids) for r in rollouts[::2]] == [len(p.token_ids) for p in prompts]
    assert sum(t == module.vision.image_token_id for t in prompts[0].token_ids) == 4
    # The sampler's logprobs equal the update's scoring of the same rows (generation and training agree).
    from lightning_grpo.batch import pack_rollouts

    batch = pack_rollouts(rollouts, torch.zeros(4), torch.zeros(4), module.tokenizer.pad_token_id)
    with torch.no_grad():
        module.policy.eval()
        scored = module.scorer.logprobs(module.policy, batch)
    sampled = batch.rollout_logprobs[:, 1:]
    mask = batch.completion_mask[:, 1:]
    assert torch.allclose(scored[mask], sampled[mask], atol=1e-4)


def test_hf_image_sampling_follows_the_per_prompt_seed_contract(tiny_vlm_dir):
    """Image prompts are drawn by our inverse-CDF sampler like text: a completion depends on its seed, prompt id and
    sample index, not on the batch it shares; the same seed repeats; the sampler's logprobs are the policy's."""
    from lightning_grpo.batch import pack_rollouts
    from lightning_grpo.collect.prompts import step_prompts
    from lightning_grpo.data.images import with_image_parts
    from lightning_grpo.data.prompts import PromptRecord
    from lightning_grpo.rollout.base import SamplingConfig
    from lightning_grpo.rollout.hf import HFEngine

    module = make(tiny_vlm_dir)
    engine = HFEngine(module.policy, module.tokenizer, vision=module.vision)
    records = [PromptRecord(i, "what?", None, {}, with_image_parts("what?", 1), (png(s, seed=i),))
               for i, s in enumerate([(56, 56), (28, 56), (84, 56)])]
    prompts, _ = step_prompts(records, module.tokenizer, module.vision)
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, logprobs=True, seed=11,
                              forbidden_token_ids=module.vision.special_ids)  # as GRPOModule.sampling() sets them
    both = engine.generate(prompts, 3, sampling)
    again = engine.generate(prompts, 3, sampling)
    alone = engine.generate(prompts[2:], 3, sampling)  # prompt 2 without its batch-mates (other padding too)
    assert [r.token_ids for r in both] == [r.token_ids for r in again]
    assert [r.token_ids for r in both[6:]] == [r.token_ids for r in alone]
    other = engine.generate(prompts, 3, SamplingConfig(max_new_tokens=8, temperature=1.0, seed=12))
    assert [r.token_ids for r in both] != [r.token_ids for r in other]
    batch = pack_rollouts(both, torch.zeros(9), torch.zeros(9), module.tokenizer.pad_token_id)
    with torch.no_grad():
        module.policy.eval()
        scored = module.scorer.logprobs(module.policy, batch)
    mask = batch.completion_mask[:, 1:]
    assert torch.allclose(scored[mask], batch.rollout_logprobs[:, 1:][mask], atol=1e-4)


def test_text_only_policy_refuses_image_records(tiny_policy_dir, tmp_path):
    from lightning.pytorch import Trainer

    from lightning_grpo.data.prompts import PromptDataModule

    rows = [{"prompt": "which color?", "answer": "red", "images": png((56, 56))} for _ in range(8)]
    module = GRPOModule(policy=PolicyConfig(path=str(tiny_policy_dir)),
                        rl=GRPOConfig(batch_per_replica=4, group_size=2), rollout=RolloutConfig(max_new_tokens=2))
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="has prompts with images but policy.path=.* is a text-only model"):
        trainer.fit(module, datamodule=PromptDataModule(rows, val_size=0))


def test_opd_refuses_image_records(tiny_vlm_dir, tmp_path):
    """OPD scores the student's hidden states without pixels: refused on image data at setup, naming the fix."""
    from lightning.pytorch import Trainer

    from lightning_grpo.data.prompts import PromptDataModule
    from lightning_grpo.objectives.opd import OPDConfig

    rows = [{"prompt": "which color?", "answer": "red", "images": png((56, 56))} for _ in range(8)]
    module = GRPOModule(policy=PolicyConfig(path=str(tiny_vlm_dir)), objective="opd",
                        opd=OPDConfig(teacher=PolicyConfig(path=str(tiny_vlm_dir))),
                        rl=GRPOConfig(batch_per_replica=4, group_size=2), rollout=RolloutConfig(max_new_tokens=2))
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="model.objective=opd does not score prompts with images.*objective=grpo"):
        trainer.fit(module, datamodule=PromptDataModule(rows, val_size=0))


def _fit_rows(policy_dir, rows, root, loop_steps, on_bad_record="error"):
    from lightning.pytorch import Trainer

    from lightning_grpo.data.prompts import PromptDataModule
    from lightning_grpo.data.rewards import RewardSpec

    module = GRPOModule(policy=PolicyConfig(path=str(policy_dir)), rl=GRPOConfig(batch_per_replica=4, group_size=2),
                        rollout=RolloutConfig(max_new_tokens=3), rewards=[RewardSpec(name="exact")])
    dm = PromptDataModule(rows, val_size=0, shuffle=False, on_bad_record=on_bad_record)
    trainer = Trainer(max_steps=loop_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    return module, dm, trainer


def _rows_with_unreadable_image(tmp_path, bad_row=3):
    """A truncated PNG: it exists (a missing file is refused when the data loads), its pixels do not decode."""
    good = tmp_path / "good.png"
    good.write_bytes(png((56, 56)))
    (tmp_path / "broken.png").write_bytes(png((56, 56))[:40])
    rows = [{"prompt": "which color?", "answer": "red", "images": str(good)} for _ in range(8)]
    rows[bad_row]["images"] = str(tmp_path / "broken.png")
    return rows


def test_unreadable_image_stops_at_the_step_that_draws_it(tiny_vlm_dir, tmp_path):
    """Row 3 is drawn at loop step 1 (2 prompts per step, source order): step 0 trains, step 1 names id and path."""
    module, dm, trainer = _fit_rows(tiny_vlm_dir, _rows_with_unreadable_image(tmp_path), tmp_path, 3)
    with pytest.raises(Exception, match=r"record id=3: cannot read image .*broken\.png") as err:
        trainer.fit(module, datamodule=dm)
    assert "on_bad_record=skip" in str(err.value)
    assert module.loop_step == 1 and trainer.global_step == 1  # the earlier step trained; nothing after it


def test_on_bad_record_skip_counts_and_continues(tiny_vlm_dir, tmp_path):
    module, dm, trainer = _fit_rows(tiny_vlm_dir, _rows_with_unreadable_image(tmp_path), tmp_path, 4, "skip")
    seen = []
    real = module.forward_chunk
    module.forward_chunk = lambda c, o: (seen.append(c), real(c, o))[1]
    trainer.fit(module, datamodule=dm)
    assert module.loop_step == 4 and dm.bad_records_skipped == 1
    assert module.last_metrics["data/bad_records_skipped"] == 1.0
    skipped_step = seen[1]  # loop step 1: its second group (record 3) is the skipped one
    assert skipped_step.group_ids.tolist() == [2, 2, 3, 3]
    assert skipped_step.completion_mask[2:].sum() == 0 and skipped_step.advantages[2:].abs().sum() == 0
    assert skipped_step.images[2:] == ((), ())  # no image to decode for the skipped rows


def test_vllm_request_carries_images_and_unexpanded_placeholders(tiny_vlm_dir):
    """vLLM gets ``multi_modal_data`` and one placeholder per image (it expands them itself); the rollout keeps
    our expanded prompt. (vLLM's Qwen-VL model class itself does not import on this CPU build: docs/vlm.md.)"""
    from lightning_grpo.collect.prompts import step_prompts
    from lightning_grpo.data.images import load_images, with_image_parts
    from lightning_grpo.data.prompts import PromptRecord
    from lightning_grpo.rollout.vllm_requests import model_image_token_id, vllm_request

    module = make(tiny_vlm_dir)
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "same?"}]}]
    records = [PromptRecord(0, "same?", None, {}, two, (png((56, 56)), png((84, 56)))),
               PromptRecord(1, "plain", None, {}, with_image_parts("plain", 0))]
    prompts, _ = step_prompts(records, module.tokenizer, module.vision)
    token = model_image_token_id(tiny_vlm_dir)
    assert token == module.vision.image_token_id
    request = vllm_request(prompts[0], token, load_images)
    assert request["prompt_token_ids"] == records[0].to_prompt(module.tokenizer).token_ids  # 1 placeholder per image
    assert [im.size for im in request["multi_modal_data"]["image"]] == [(56, 56), (84, 56)]
    assert sum(t == token for t in prompts[0].token_ids) == 4 + 6  # what the update scores: expanded
    assert vllm_request(prompts[1], token) == {"prompt_token_ids": prompts[1].token_ids}


def test_completions_end_before_a_vision_token(tiny_vlm_dir):
    """A vision placeholder in a completion would claim an image that is not there: a completion ends right before
    the first vision token it samples (unfinished), and its sampler logprobs stay the policy's own."""
    from lightning_grpo.rollout.base import Prompt
    from lightning_grpo.rollout.hf import HFEngine

    module = make(tiny_vlm_dir)
    forbidden = module.sampling().forbidden_token_ids
    assert module.vision.image_token_id in forbidden and len(forbidden) == 4  # start, end, image and video pads
    with torch.no_grad():  # make the vision tokens likely
        module.policy.lm_head.weight[list(forbidden)] *= 20
    engine = HFEngine(module.policy, module.tokenizer, vision=module.vision)
    prompt = Prompt(0, module.tokenizer("hello")["input_ids"])
    free = engine.generate([prompt], 8, type(module.sampling())(max_new_tokens=6, seed=1, logprobs=True))
    hit = [i for i, r in enumerate(free) if any(t in forbidden for t in r.token_ids)]
    assert hit  # unchecked they do come out
    cut = engine.generate([prompt], 8, replace(module.sampling(), max_new_tokens=6, seed=1, logprobs=True))
    assert not any(t in forbidden for r in cut for t in r.token_ids)
    for i in hit:  # the same draw (same seed), ended right before its first vision token
        first = next(j for j, t in enumerate(free[i].token_ids) if t in forbidden)
        assert cut[i].token_ids == free[i].token_ids[:first] and cut[i].finish_reason == "length"
        assert cut[i].logprobs == free[i].logprobs[:first]


@pytest.mark.slow
def test_update_peak_rss_falls_with_n_micro_one_chunks_pixels_alive(monkeypatch):
    """Fresh processes (bench/vlm_memory.py): the update's peak RSS at n_micro=4 is well under n_micro=1's, and only
    one chunk's pixel tensor was ever alive, a quarter the bytes."""
    from pathlib import Path

    from bench.vlm_memory import measure

    monkeypatch.chdir(Path(__file__).parents[1])  # python -m bench.vlm_memory from the repository root
    one, four = measure(rows=16, side=336, completion=32, n_micros=[1, 4])
    assert one["max_pixel_tensors_alive"] == four["max_pixel_tensors_alive"] == 1
    assert four["chunks_materialized"] == 4 and four["max_pixel_mb_alive"] <= one["max_pixel_mb_alive"] / 4 + 0.1
    assert four["update_peak_mb"] < 0.75 * one["update_peak_mb"], (one, four)  # measured 0.45x (bench --quick)


def test_rollout_logprobs_path_with_images(tiny_vlm_dir):
    """rollout_correction.mode=bypass on image prompts: the engine's sampler logprobs (vision tokens suppressed) are
    pi_old; before any step they equal the policy's own scoring of the expanded rows, so the first ratio is 1."""
    from lightning_grpo.data.images import with_image_parts
    from lightning_grpo.data.prompts import PromptRecord
    from lightning_grpo.data.rewards import RewardSpec
    from lightning_grpo.rollout.hf import HFEngine

    rl = GRPOConfig(batch_per_replica=8, group_size=4, mini_batch_per_replica=4, rollout_correction={"mode": "bypass"})
    module = GRPOModule(policy=PolicyConfig(path=str(tiny_vlm_dir)), rl=rl, rollout=RolloutConfig(max_new_tokens=5),
                        rewards=[RewardSpec(name="exact")])
    module.configure_model()
    module.updater.attach(torch.optim.SGD(module.policy.parameters(), lr=0.1))
    module.engine = HFEngine(module.policy, module.tokenizer, vision=module.vision)
    module.collector = module.configure_collector()
    records = [PromptRecord(i, "which color?", "red", {}, with_image_parts("which color?", 1), (png((56, 56)),))
               for i in range(2)]
    batch, _ = module.collect(records)
    assert batch.rollout_logprobs is not None and batch.images is not None
    objective, first = module.objective, []

    def chunk_loss(chunk, policy, old):  # the objective's own scoring, with its inputs recorded
        lp, mask = policy.logprobs(chunk), chunk.completion_mask[:, 1:]
        first.append((lp.detach(), old, mask))
        return objective(lp, mask, chunk.advantages, old, None, chunk.rollout_logprobs[:, 1:])

    objective.chunk_loss = chunk_loss
    result = module.updater.update(batch)
    assert not any(s.skipped for s in result.steps)
    lp, old, mask = first[0]
    assert torch.allclose(lp[mask], old[mask], atol=1e-4)  # mini-batch 0 scores before any step: ratio 1
