"""LoRA policies (policy.lora through peft): what trains, the reference, chunked equivalence, the ahead pass,
checkpoints in peft's format with exact resume, the merged-weight view, and the bad-input refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import StepRecorder, fit_tiny, global_determinism_restored, max_rel_delta, params_of, synthetic_batch

from lightning_grpo import lora
from lightning_grpo.checkpoint import GRPOCheckpoint
from lightning_grpo.checkpoint import adapter as adapter_checkpoint
from lightning_grpo.checkpoint.paths import adapter_path, checkpoint_name
from lightning_grpo.config import ConfigError, GRPOConfig, OptimConfig, RolloutConfig
from lightning_grpo.data.rewards import RewardSpec
from lightning_grpo.lora import LoraConfig
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig, load_policy
from lightning_grpo.rollout import adapter_sync
from lightning_grpo.timing import is_timing

UNEQUAL = [1, 12, 3, 20, 2, 7, 15, 4]
LENS = [3, 9, 1, 6, 12, 2, 5, 8, 4, 10, 7, 11, 6, 2, 9, 3]
ADAPTER = LoraConfig(rank=4, alpha=8)


def lora_module(policy_dir, cfg: LoraConfig | None = ADAPTER, dtype="float32", seed=0, **rl) -> GRPOModule:
    rl = {"batch_per_replica": 8, "group_size": 2, **rl}
    module = GRPOModule(policy=PolicyConfig(path=str(policy_dir), dtype=dtype, lora=cfg), rl=GRPOConfig(**rl),
                        seed=seed)
    module.configure_model()  # no Trainer: build the policy ourselves
    return module


def moved_adapter(module, scale=0.05):
    """Give every adapter tensor a random value (B starts at 0: the adapted policy would equal the base)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in module.policy.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def logprobs_of(model, batch):
    from lightning_grpo.logprobs import token_logprobs

    with torch.no_grad():
        return token_logprobs(model.eval(), batch.input_ids, batch.attention_mask,
                              positions=batch.completion_mask[:, 1:])  # what the module scores: completion tokens


# -- config and bad input --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, rule", [
    ("rank", 0, "rank=0: must be an integer >= 1"),
    ("alpha", 0, "alpha=0: must be > 0"),
    ("dropout", 1.0, r"dropout=1.0: must be in \[0, 1\)"),
    ("target_modules", [], "name at least one module"),
    ("target_modules", "q_proj(", "not a valid regex"),
    ("sync", "push", "sync='push': must be 'adapter' or 'merge'"),
])
def test_each_config_rule_is_checked_at_load(field, value, rule):
    with pytest.raises(ConfigError, match=rule):
        LoraConfig(**{field: value})


def test_config_errors_are_reported_together():
    with pytest.raises(ConfigError, match=r"rank=0(.|\n)*alpha=-1(.|\n)*sync='x'"):
        LoraConfig(rank=0, alpha=-1, sync="x")


@pytest.mark.parametrize("cfg, named", [
    (LoraConfig(target_modules=["q_proj", "qkv_proj"]), "target_modules entry 'qkv_proj'"),
    (LoraConfig(target_modules=r"model\.layers\.\d+\.attn\.q"), "target_modules="),
    (LoraConfig(modules_to_save=["score"]), "modules_to_save entry 'score'"),
])
def test_targets_that_match_nothing_are_refused_at_setup_listing_module_names(tiny_policy_dir, cfg, named):
    module = GRPOModule(policy=PolicyConfig(path=str(tiny_policy_dir), lora=cfg))
    with pytest.raises(ValueError, match="matches no module") as err:
        module.configure_model()
    message = str(err.value)
    assert named in message
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"):
        assert name in message  # what the user can write instead
    assert module.policy is None  # nothing half-built


def test_lora_section_round_trips_through_the_cli_parser(tmp_path, capsys):
    import yaml

    from lightning_grpo.cli import flatten, main

    with pytest.raises(SystemExit):
        main(["fit", "--model.policy.lora.rank=8", "--model.policy.lora.target_modules=[q_proj,v_proj]",
              "--model.policy.lora.sync=merge", "--print_config"])
    printed = flatten(yaml.safe_load(capsys.readouterr().out))
    assert printed["model.policy.lora.rank"] == 8 and printed["model.policy.lora.sync"] == "merge"
    assert printed["model.policy.lora.target_modules"] == ["q_proj", "v_proj"]
    assert printed["model.policy.lora.dropout"] == 0.0


def test_fsdp2_with_lora_is_refused_at_setup_before_the_policy_is_built(tiny_policy_dir):
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy

    module = GRPOModule(policy=PolicyConfig(path=str(tiny_policy_dir), lora=ADAPTER))
    module.trainer = Trainer(strategy=ModelParallelStrategy(), accelerator="cpu", devices=1, logger=False)
    with pytest.raises(ValueError, match="ModelParallelStrategy.*--trainer.strategy=ddp"):
        module.setup("fit")
    assert module.policy is None


def test_adapter_init_follows_the_module_seed_not_the_global_rng(tiny_policy_dir):
    torch.manual_seed(1)
    a = params_of(lora_module(tiny_policy_dir, seed=3).policy)
    torch.rand(1000)  # the global stream moved: a DDP rank or a rerun may have drawn more before building
    b = params_of(lora_module(tiny_policy_dir, seed=3).policy)
    c = params_of(lora_module(tiny_policy_dir, seed=4).policy)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if ".lora_A." in k)


# -- what trains -----------------------------------------------------------------------------------------------------
def test_only_the_adapter_gets_gradients_and_optimizer_state(tiny_policy_dir):
    module = lora_module(tiny_policy_dir)
    optimizer = module.configure_optimizers()[0][0]
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for p in module.policy.parameters() if p.requires_grad}
    module.updater.attach(optimizer)
    before = params_of(module.policy)
    for seed in (0, 1):  # the second step moves A too (its gradient is 0 while B is 0)
        module.updater.update(synthetic_batch(UNEQUAL, seed=seed))
    after = params_of(module.policy)
    for name in before:
        changed = not torch.equal(before[name], after[name])
        assert changed == (name in trainable), name  # the base is bit-for-bit untouched, every adapter tensor moved
    stateful = {id(p) for p, s in optimizer.state.items() if s}
    assert stateful == {id(p) for p in module.policy.parameters() if p.requires_grad}
    assert all(p.grad is None for p in module.policy.parameters() if not p.requires_grad)


def test_trained_parameters_and_optimizer_state_shrink(tiny_policy_dir):
    sizes = {}
    for name, cfg in (("full", None), ("lora", ADAPTER)):
        module = lora_module(tiny_policy_dir, cfg)
        optimizer = module.configure_optimizers()[0][0]
        module.updater.attach(optimizer)
        module.updater.update(synthetic_batch(UNEQUAL, seed=0))
        state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim() > 0)
        sizes[name] = (lora.parameter_counts(module.policy)["trainable"], state)
    (full_params, full_state), (lora_params, lora_state) = sizes["full"], sizes["lora"]
    assert lora_state == 2 * 4 * lora_params  # AdamW: two float32 moments per trained element, nothing else
    assert lora_params < 0.2 * full_params and lora_state < 0.2 * full_state


def test_kl_reference_is_the_base_with_the_adapter_disabled_and_no_copy(tiny_policy_dir):
    module = lora_module(tiny_policy_dir, beta=0.1)
    assert module.ref is None  # no second model
    moved_adapter(module)
    batch = synthetic_batch(UNEQUAL, seed=2)
    base, _ = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    expected = logprobs_of(base, batch)
    torch.testing.assert_close(module.scorer.reference_logprobs(batch), expected, atol=1e-6, rtol=0)
    assert (logprobs_of(module.policy, batch) - expected).abs().max() > 1e-2  # the adapted policy differs
    _, _, stats = module.forward_chunk(batch, None)
    assert float(stats.kl) > 0


# -- exactness under every split -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_micro", [2, 4, 8])
def test_chunked_lora_step_equals_unchunked(tiny_policy_dir, n_micro):
    batch = synthetic_batch(UNEQUAL, seed=1)
    whole = lora_module(tiny_policy_dir, dtype="float64")
    chunked = lora_module(tiny_policy_dir, dtype="float64", micro_batch_per_replica=8 // n_micro)
    for m in (whole, chunked):
        moved_adapter(m)  # so A and B both get gradients
    before = params_of(whole.policy)
    for m in (whole, chunked):
        m.updater.attach(torch.optim.SGD([p for p in m.policy.parameters() if p.requires_grad], lr=0.1))
        result = m.updater.update(batch)
        assert len(result.steps) == 1 and not result.steps[0].skipped
    assert max_rel_delta(before, params_of(whole.policy), params_of(chunked.policy)) <= 5e-8


def test_ahead_pass_freezes_pi_old_with_adapters(tiny_policy_dir):
    module = lora_module(tiny_policy_dir, batch_per_replica=16, mini_batch_per_replica=4, micro_batch_per_replica=2)
    moved_adapter(module)
    module.updater.attach(torch.optim.AdamW([p for p in module.policy.parameters() if p.requires_grad],
                                                     lr=5e-2))
    result = module.updater.update(synthetic_batch(LENS, seed=0))
    assert len(result.steps) == 4 and module.updater.ahead.state_dict()["probe"]["fraction"] == 0  # probe ran, passed
    windows = [result.chunks[i:i + 2] for i in range(0, 8, 2)]
    assert [(float(c.ratio_mean), float(c.clip_frac)) for c in windows[0]] == [(1.0, 0.0)] * 2
    later = [c for w in windows[1:] for c in w]
    assert all(float(c.ratio_mean) != 1.0 for c in later)
    assert any(float(c.clip_frac) > 0 for c in later)


# -- the merged view the merge sync pushes ---------------------------------------------------------------------------
def test_merged_weights_reproduce_the_adapted_policy_and_leave_the_base_untouched(tiny_policy_dir):
    module = lora_module(tiny_policy_dir, LoraConfig(rank=4, alpha=8, modules_to_save=["model.norm"]))
    moved_adapter(module)
    base_before = {n: p.clone() for n, p in module.policy.named_parameters() if not p.requires_grad}
    merged = dict(adapter_sync.engine_weights(module.policy, merged=True))
    plain, _ = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    assert set(merged) == {n for n, _ in plain.named_parameters()}  # checkpoint names, each once
    loaded = plain.load_state_dict(merged, strict=False)
    assert loaded.missing_keys == ["lm_head.weight"] and not loaded.unexpected_keys  # tied to the embedding
    batch = synthetic_batch(UNEQUAL, seed=5)
    torch.testing.assert_close(logprobs_of(plain, batch), logprobs_of(module.policy, batch), atol=2e-5, rtol=0)
    assert all(torch.equal(p, base_before[n]) for n, p in module.policy.named_parameters() if not p.requires_grad)
    unmerged = dict(adapter_sync.engine_weights(module.policy, merged=False))  # what an adapter-serving engine holds
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(unmerged[q], base_before[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"])
    assert torch.equal(unmerged["model.norm.weight"], merged["model.norm.weight"])  # trained in full: as trained
    only = dict(adapter_sync.engine_weights(module.policy, merged=False, modules_to_save_only=True))
    assert list(only) == ["model.norm.weight"]


def test_a_tied_embedding_in_modules_to_save_is_refused(tiny_policy_dir):
    with pytest.raises(ValueError, match="tied embeddings"):
        lora_module(tiny_policy_dir, LoraConfig(modules_to_save=["lm_head"]))


# -- checkpoints -----------------------------------------------------------------------------------------------------
JOB = {"rl": {"batch_per_replica": 8, "group_size": 4, "mini_batch_per_replica": 4, "deterministic": True},
       "optim": {"lr": 1e-2, "warmup_steps": 1, "schedule": "cosine", "total_steps": 8}}  # horizon fixed: runs of 2 and 4


def job_module(policy_dir, cfg=ADAPTER, beta=0.0):
    return GRPOModule(policy=PolicyConfig(path=str(policy_dir), lora=cfg),
                      rl=GRPOConfig(**JOB["rl"], beta=beta), optim=OptimConfig(**JOB["optim"]),
                      rollout=RolloutConfig(engine="hf", max_new_tokens=4),
                      rewards=[RewardSpec(name="helpers:digit_share")], seed=0)


@pytest.mark.heavy  # two fits: CI and `make test-integration`
def test_checkpoints_hold_the_adapter_in_peft_format_and_resume_exactly(tmp_path, tiny_policy_dir):
    from peft import PeftModel

    with global_determinism_restored():
        straight = StepRecorder()
        fit_tiny(job_module(tiny_policy_dir, beta=0.05), tmp_path / "a", 4, [straight])
        first = StepRecorder()
        saver = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=1, keep_last=0)
        module = job_module(tiny_policy_dir, beta=0.05)
        fit_tiny(module, tmp_path / "b", 2, [first, saver])
        ckpt = saver.last_path  # loop step 2
        resumed, module2 = StepRecorder(), job_module(tiny_policy_dir, beta=0.05)
        fit_tiny(module2, tmp_path / "c", 4, [resumed], ckpt_path=str(ckpt))
    strip = [{k: v for k, v in m.items() if not is_timing(k)} for m in straight.metrics]
    again = [{k: v for k, v in m.items() if not is_timing(k)} for m in first.metrics + resumed.metrics]
    assert strip == again  # bit-identical continuation
    assert params_of(module2.policy).keys() == params_of(module.policy).keys()

    saved = torch.load(ckpt, weights_only=True)
    keys = saved["state_dict"].keys()
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)  # the frozen base is not in it
    trained = sum(p.numel() for p in module.policy.parameters() if p.requires_grad)
    assert sum(t.numel() for t in saved["state_dict"].values()) == trained

    # The folder beside it (and one exported from the checkpoint alone) loads with PeftModel.from_pretrained.
    exported = adapter_checkpoint.export_adapter(ckpt, tmp_path / "exported")
    batch = synthetic_batch(UNEQUAL, seed=6)
    expected = logprobs_of(module.policy, batch)  # fit ended at loop step 2: the policy the checkpoint holds
    for folder in (adapter_path(ckpt), exported):
        base, _ = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
        loaded = PeftModel.from_pretrained(base, str(folder))
        torch.testing.assert_close(logprobs_of(loaded, batch), expected, atol=0, rtol=0)


def test_resume_onto_another_base_is_refused(tmp_path, tiny_policy_dir, tiny_chat_policy_dir):
    saver = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=1, keep_last=0)
    fit_tiny(job_module(tiny_policy_dir), tmp_path / "a", 1, [saver])
    from helpers import SMALL

    from lightning_grpo.tiny.build import build_tiny_policy

    other = build_tiny_policy(tmp_path / "other", dataclasses.replace(SMALL, seed=1))  # same shapes, other weights
    with pytest.raises(ValueError, match="trained on another base model"):
        fit_tiny(job_module(other), tmp_path / "b", 2, ckpt_path=str(saver.last_path))


def test_pruning_removes_the_adapter_folder_with_its_checkpoint(tmp_path, tiny_policy_dir):
    saver = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=1, keep_last=1)
    fit_tiny(job_module(tiny_policy_dir), tmp_path / "a", 2, [saver])
    assert saver.last_path.name.startswith(checkpoint_name(2).removesuffix(".ckpt"))
    adapters = sorted(p.name for p in (tmp_path / "ckpt").glob("*.adapter"))
    assert adapters == [adapter_path(saver.last_path).name]  # loop step 1's went with its checkpoint
    assert (adapter_path(saver.last_path) / "adapter_model.safetensors").exists()
