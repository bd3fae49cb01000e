"""One rank of the 2-process data-parallel checks (tests/test_distributed.py launches two of these).

Each process is started the way torchrun or SLURM would start it (``LOCAL_RANK``, ``NODE_RANK``,
``MASTER_ADDR``, ``MASTER_PORT`` in the environment), so Lightning spawns nothing and every
case below reuses one gloo process group. A case runs one loop step through a real
``Trainer.fit`` on this rank's share of a fixed collected batch and writes, per rank,
``<out>/<case>.rank<r>.pt``: the full (gathered) parameters after the step, the step outcomes
and the logged metrics.

Usage: python tests/dist_worker.py --out DIR --policy DIR --cases ddp-m1,fsdp2-m4,...
"""

from __future__ import annotations

import argparse
import math
import os
import traceback
from dataclasses import replace
from pathlib import Path

import torch
from helpers import synthetic_batch  # tests/ is on sys.path: it is this script's folder
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader

from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig
from lightning_grpo.data.prompts import PromptDataModule
from lightning_grpo.data.rewards import RewardSpec
from lightning_grpo.lora import LoraConfig
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.rollout.weight_sync import push_weights

# Completion lengths of the collected batch (4 groups of 2). Rank 0 takes the first half: long
# completions; rank 1 the second: short ones. A per-rank token mean weighs them wrongly.
LENGTHS = [20, 15, 12, 18, 1, 3, 2, 4]
BATCH_SEED = 7
CLIP = 0.5  # below the natural gradient norm (~1.9): clipping binds, so the norm must be the global one


def lr_of(case: str) -> float:
    """SGD step size: updates of ~0.15, so the float32 rounding of the weights (half an ulp of a norm weight
    near 1.0 is 6e-8) stays far below the 1e-6 gate; a clipped step is ~4x shorter, so its rate is 4x larger."""
    return 4.0 if "clip" in case else 1.0



BUDGET = 48  # tokens per chunk: rank 0's long rows (24 22 19 16 tokens) need 2 chunks, rank 1's short ones 1
MOE_BUDGET = 40  # with n_mini=2: rank 0's windows (24+19, 16+22 tokens) need 2 chunks each, rank 1's 1
VLM_LENGTHS = [30, 28, 26, 24, 2, 3, 2, 3]  # image prompts: rank 0's long completions need 2 chunks, rank 1's 1
VLM_SIZES = [(56, 56), (28, 28)]  # 4 and 1 image tokens


def case_config(case: str) -> GRPOConfig:
    """``<strategy>-m<n_micro>[-clip|-rankmean|-refuse|-moe]`` or ``<strategy>-budget[-moe]`` -> the rl config of
    that case (8 trajectories)."""
    parts = case.split("-")
    if parts[1] == "vlm":  # the budget is set from the image batch (VLMBatchModule.collect)
        return GRPOConfig(batch_per_replica=len(VLM_LENGTHS), group_size=2, max_tokens_per_micro=1,
                          max_grad_norm=0.0)
    if parts[1] == "budget" and "moe" in parts:  # n_mini=2, routing replay; rank 0 needs 2 chunks a window, rank 1
        return GRPOConfig(batch_per_replica=len(LENGTHS), group_size=2, mini_batch_per_replica=4,  # 1 + a filler
                          max_tokens_per_micro=MOE_BUDGET, max_grad_norm=0.0, routing_replay="ahead")
    if parts[1] == "budget":  # token-budgeted chunks: unequal chunk counts on the two ranks (-packed: padding-free)
        return GRPOConfig(batch_per_replica=len(LENGTHS), group_size=2, max_tokens_per_micro=BUDGET, max_grad_norm=0.0,
                          packed="packed" in parts)
    n_micro = int(parts[1][1:])
    if "refuse" in parts:  # mini-batch of 3 trajectories cannot split over 2 ranks
        return GRPOConfig(batch_per_replica=6, group_size=2, mini_batch_per_replica=3, max_grad_norm=0.0)
    if "moe" in parts:  # MoE routing replay: n_mini=2, so the ahead pass records and mini-batch 1 replays
        return GRPOConfig(batch_per_replica=len(LENGTHS), group_size=2, mini_batch_per_replica=4,
                          micro_batch_per_replica=4 // n_micro, max_grad_norm=0.0, routing_replay="ahead")
    return GRPOConfig(batch_per_replica=len(LENGTHS), group_size=2, micro_batch_per_replica=len(LENGTHS) // n_micro,
                      max_grad_norm=CLIP if "clip" in parts else 0.0)


def lora_seed(case: str) -> int | None:
    """``...-lora``: seed 0 on every rank and in the one-rank reference (the adapter's init follows the seed);
    other cases keep the module's default seed, as their one-rank references do."""
    return 0 if "lora" in case.split("-") else None


def policy_config(case: str, policy: str) -> PolicyConfig:
    """``...-lora``: the policy trains a rank-4 LoRA adapter on the frozen tiny policy."""
    adapter = LoraConfig(rank=4, alpha=8) if "lora" in case.split("-") else None
    return PolicyConfig(path=policy, dtype="float32", lora=adapter, train_vision_tower="vlm" in case.split("-"))


class FixedBatchModule(GRPOModule):
    """GRPOModule whose rollout phase returns this rank's share of a fixed batch, stepped with plain SGD.

    Records after every backward whether this rank holds gradients and their local sum (``grad_trace``):
    with sync skipped, DDP ranks hold different (local) gradients and FSDP2 has not reduced any yet.
    """

    nan_row: int | None = None  # rank 0 poisons this row's advantage (a non-finite chunk on one rank only)

    def collect(self, records):
        batch, world, rank = synthetic_batch(LENGTHS, seed=BATCH_SEED), self.trainer.world_size, self.global_rank
        share = len(batch) // world
        batch = batch.select(slice(rank * share, (rank + 1) * share))
        if self.nan_row is not None and rank == 0:
            batch = replace(batch, advantages=batch.advantages.index_fill(0, torch.tensor([self.nan_row]), math.nan))
        return batch, {}

    lr = 1.0

    def configure_optimizers(self):
        return torch.optim.SGD(self.policy.parameters(), lr=self.lr)  # update = lr x gradient

    def manual_backward(self, loss, *args, **kwargs) -> None:
        super().manual_backward(loss, *args, **kwargs)
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        local = sum(float((g.to_local() if hasattr(g, "to_local") else g).double().abs().sum()) for g in grads)
        self.grad_trace.append((bool(grads), local))


class VLMBatchModule(FixedBatchModule):
    """The fixed-batch module on image prompts with a budget that holds rank 1's four short rows in one chunk, so
    rank 0 (long completions) needs 2 chunks and rank 1 one plus a DP filler, its last (synced) chunk, without
    pixels."""

    def collect(self, records):
        from helpers import image_batch

        from lightning_grpo.update.plan import sequence_lengths

        batch = image_batch(self, VLM_LENGTHS, VLM_SIZES, seed=BATCH_SEED)
        lengths = sequence_lengths(batch)[0]
        self.rl.max_tokens_per_micro = 4 * max(lengths[4:])  # rank 1's four short rows fit one chunk, rank 0's not
        self.updater.split = self.split()  # the split was fixed when the optimizer was attached
        return _share(batch, self), {}


class RecordingEngine:
    """An engine that keeps the tensors a weight sync hands it."""

    def __init__(self) -> None:
        self.received: dict[str, torch.Tensor] = {}

    def load_weights(self, named_tensors) -> None:
        self.received.update((name, t.detach().clone()) for name, t in named_tensors)

    def reset_prefix_cache(self) -> None:
        pass


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor (FSDP2 shards are all-gathered: every rank must call this)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def run_fit(case: str, policy: str, out: Path, rank: int) -> None:
    """Two real loop steps (prompts -> HF generation on the sharded policy -> update -> combined metrics)."""
    module = GRPOModule(policy=PolicyConfig(path=policy, dtype="float32"), optim=OptimConfig(lr=1e-3),
                        rl=GRPOConfig(batch_per_replica=8, group_size=2, micro_batch_per_replica=4),
                        rollout=RolloutConfig(max_new_tokens=8),
                        rewards=[RewardSpec("arith"), RewardSpec("reward_fns:length_reward", weight=0.1)])
    trainer = Trainer(accelerator="cpu", devices=2, strategy=_strategy(case), max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0)
    trainer.fit(module, datamodule=PromptDataModule("builtin:arith", builtin_size=64, val_size=0))
    record = {"case": case, "params": full_params(module.policy), "metrics": dict(module.last_metrics),
              "sampling_seed": module.sampling().seed}
    torch.save(record, out / f"{case}.rank{rank}.pt")


def run_dynamic_fit(case: str, policy: str, out: Path, rank: int) -> None:
    """DAPO dynamic sampling on 2 ranks (test_dynamic_sampling.rank0_short): each rank draws one informative and one
    flat group; rank 1's first refill round brings an informative group, rank 0's never do: rank 0 stays short,
    rank 1 is full after one round, and both must agree to draw all max_refill_rounds rounds (rank 1 generating
    nothing) without a hang."""
    module = GRPOModule(policy=PolicyConfig(path=policy, dtype="float32"), optim=OptimConfig(lr=1e-3),
                        rl=GRPOConfig(batch_per_replica=8, group_size=2, dynamic_sampling=True, max_refill_rounds=3),
                        rollout=RolloutConfig(max_new_tokens=8), rewards=[RewardSpec("test_dynamic_sampling:rank0_short")])
    trained = []
    module.update = lambda batch, real=module.update: trained.append(batch) or real(batch)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0)
    trainer.fit(module, datamodule=PromptDataModule("builtin:arith", builtin_size=64, val_size=0))
    record = {"case": case, "params": full_params(module.policy), "metrics": dict(module.last_metrics),
              "group_ids": trained[0].group_ids.tolist(), "rewards": trained[0].rewards.tolist(),
              "trained_rows": trained[0].completion_mask.any(-1).tolist()}
    torch.save(record, out / f"{case}.rank{rank}.pt")


class EngineFollows(Callback):
    """After each publication (listed after the HandoffCallback): engine and trainer logprobs of a fixed sequence."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.pairs = ids, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from vllm import SamplingParams

        out = pl_module.engine.llm.generate([{"prompt_token_ids": self.ids}], SamplingParams(
            max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        engine = torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], self.ids[1:])])
        with torch.no_grad():
            logits = pl_module.policy(torch.tensor([self.ids])).logits[0, :-1].float()
        policy = torch.log_softmax(logits, -1).gather(1, torch.tensor(self.ids[1:])[:, None])[:, 0]
        self.pairs.append((engine, policy))


def run_vllm_fit(case: str, policy: str, out: Path, rank: int) -> None:
    """Three loop steps on DDP, each rank generating with its own in-process vLLM CPU engine (external_launcher)."""
    from lightning_grpo.config import VLLMConfig
    from lightning_grpo.handoff import HandoffCallback

    vllm = VLLMConfig(dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=32 << 20,
                      distributed_executor_backend="external_launcher")
    module = GRPOModule(policy=PolicyConfig(path=policy, dtype="float32"), optim=OptimConfig(lr=3e-3),
                        rl=GRPOConfig(batch_per_replica=8, group_size=2, micro_batch_per_replica=4),
                        rollout=RolloutConfig(engine="vllm", vllm=vllm, max_new_tokens=6, sync_bucket_mb=0.05),
                        rewards=[RewardSpec("helpers:digit_share")])  # varies within groups: the policy moves
    handoff, follows = HandoffCallback(), EngineFollows(list(range(5, 40)))
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, callbacks=[handoff, follows])
    try:
        trainer.fit(module, datamodule=PromptDataModule("builtin:arith", builtin_size=64, val_size=0))
        record = {"case": case, "params": full_params(module.policy), "metrics": dict(module.last_metrics),
                  "events": handoff.events, "sync": vars(handoff.last_sync), "pairs": follows.pairs,
                  "engine": type(module.engine).__name__, "sampling_seed": module.sampling().seed}
    finally:
        if module.engine is not None:
            module.engine.close()
    torch.save(record, out / f"{case}.rank{rank}.pt")


def _strategy(case: str):
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if case.startswith("fsdp2") else "ddp"


FAMILY = {  # grpo-<name>-m<n>: the loss family and rollout corrections (tests/objectives/test_objectives_distributed.py)
    "grpo": {"loss_type": "grpo"}, "drgrpo": {"loss_type": "dr_grpo"}, "seqsum": {"loss_type": "seq-mean-token-sum"},
    "gspo": {"ratio_level": "sequence"}, "cispo": {"loss": "cispo"},
    "tis": {"rollout_correction": {"mode": "tis", "threshold": 1.3}},
    "tisseq": {"loss_type": "grpo", "rollout_correction": {"mode": "tis", "level": "sequence", "threshold": 1.5}},
    "maskgeo": {"rollout_correction": {"mode": "mask", "level": "geometric", "band": [0.9, 1.1]}},
    "icepop": {"loss": "cispo", "rollout_correction": {"mode": "icepop"}},
    "bypass": {"ratio_level": "sequence", "rollout_correction": {"mode": "bypass"}},
    "entropy": {"loss_type": "grpo", "entropy_coef": 0.05, "top_entropy_quantile": 0.5},
    "holes": {"rollout_correction": {"mode": "tis", "threshold": 1.3}},  # multi-turn rows: tool tokens in the middle
}
FAMILY_LR = {"grpo": 0.2, "drgrpo": 1.5, "seqsum": 0.05, "gspo": 0.5, "cispo": 0.5, "tis": 0.4, "tisseq": 0.1,
             "maskgeo": 0.8, "icepop": 0.2, "bypass": 0.3, "entropy": 0.35, "holes": 0.4}
"""SGD rates that make each family case's update ~0.15 (measured on one rank; their gradients differ in scale)."""


def objective_batch(case: str, module):
    """The whole fixed batch of an objective case; grpo cases carry sampler logprobs (the initial policy's plus
    noise, the same on every rank: each starts from the same weights)."""
    from helpers import with_sampler_logprobs

    batch = synthetic_batch(LENGTHS, seed=BATCH_SEED)
    if "holes" in case:
        batch = with_tool_turns(batch)
    return with_sampler_logprobs(batch, module.policy, sigma=0.5) if case.startswith("grpo") else batch


def with_tool_turns(batch):
    """Episodes: completion tokens 3-6 of every row longer than 8 become a tool result between two model turns
    (context, mask 0), as ``pack_rollouts`` lays out ``Rollout.model_mask``; only rank 0's rows are that long."""
    holes = torch.zeros_like(batch.completion_mask)
    holes[[i for i, n in enumerate(LENGTHS) if n > 8], 4 + 3: 4 + 7] = True  # synthetic_batch's prompt_len is 4
    return replace(batch, completion_mask=batch.completion_mask & ~holes)


def objective_lr(case: str) -> float:
    """SGD step size of an objective case: updates of ~0.15 (measured on one rank), far above float32 rounding."""
    if case.startswith("dpo"):
        return 0.1
    if case.startswith("grpo"):
        return FAMILY_LR[case.split("-")[1]]
    return 1.0 if "rewards" in case else 30.0 if "full" in case else 4.0


def run_objective_case(case: str, policy: str, teacher: str, out: Path, rank: int) -> None:
    """``opd-<kl>-m<n>`` / ``dpo-m<n>``: one step on this rank's share of the fixed batch, as ``one_rank_objective``."""
    module = objective_module(case, policy, teacher)
    if case.startswith(("opd", "grpo")):
        module.collect = lambda records: (_share(objective_batch(case, module), module), {})
    else:
        module.encode = lambda pairs, real=module.encode: _share(real(dpo_pairs()), module)
    module.configure_optimizers = lambda: torch.optim.SGD(module.policy.parameters(), lr=objective_lr(case))
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, limit_train_batches=1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
    trainer.fit(module, train_dataloaders=DataLoader([[0]], batch_size=None))
    torch.save({"case": case, "params": full_params(module.policy), "metrics": dict(module.last_metrics)},
               out / f"{case}.rank{rank}.pt")


def objective_module(case: str, policy: str, teacher: str):
    """The module of an objective case (also the 1-rank reference): 8 trajectories or pairs, n_micro chunks
    (``grpo-<family>-m<n>``: n_mini = 2, so pi_old is frozen and the second mini-batch's ratio is off 1)."""
    from lightning_grpo.dpo import DPOConfig, DPOModule
    from lightning_grpo.objectives.opd import OPDConfig

    # float64: 2 ranks vs 1 differ only by summation order, ~1e-15 relative (in float32 another CPU's rounding reached
    # 1.3e-6 of the update, over a 1e-6 bar), so the comparison holds to 1e-12 (measured <= 2e-15)
    n_micro = int(case.split("-")[-1][1:])
    if case.startswith("dpo"):
        return DPOModule(PolicyConfig(path=policy, dtype="float64"),
                         DPOConfig(batch_size=len(LENGTHS), grad_accum=n_micro, max_grad_norm=0.0, beta=0.5))
    if case.startswith("grpo"):
        rl = GRPOConfig(batch_per_replica=len(LENGTHS), group_size=2, mini_batch_per_replica=4,
                        micro_batch_per_replica=4 // n_micro, max_grad_norm=0.0, **FAMILY[case.split("-")[1]])
        return GRPOModule(policy=PolicyConfig(path=policy, dtype="float64"), rl=rl, rollout=RolloutConfig())
    rl = GRPOConfig(batch_per_replica=len(LENGTHS), group_size=2, micro_batch_per_replica=len(LENGTHS) // n_micro,
                    max_grad_norm=0.0)
    opd = OPDConfig(teacher=PolicyConfig(path=teacher, dtype="float64"), kl=case.split("-")[1],
                    use_rewards="rewards" in case)
    return GRPOModule(policy=PolicyConfig(path=policy, dtype="float64"), rl=rl, rollout=RolloutConfig(),
                      objective="opd", opd=opd)


def dpo_pairs():
    """8 pairs whose answers differ in length (rank 0 gets the long ones)."""
    from lightning_grpo.data.preferences import PreferencePair, builtin_pairs

    base = builtin_pairs("arith_small", "train", len(LENGTHS), seed=3)
    return [PreferencePair(p.id, p.prompt, p.chosen * (1 + n % 7), p.rejected) for p, n in zip(base, LENGTHS)]


def _share(batch, module):
    """This rank's contiguous share of a batch (the whole batch outside a distributed run)."""
    world = module.trainer.world_size if module._trainer is not None else 1
    rank, size = (module.global_rank if world > 1 else 0), len(batch) // world
    return batch.select(slice(rank * size, (rank + 1) * size))


def run_case(case: str, policy: str, out: Path, rank: int, teacher: str | None = None) -> None:
    if case.startswith(("opd-", "dpo-", "grpo-")):
        return run_objective_case(case, policy, teacher, out, rank)
    if case == "ddp-vllm-fit":
        return run_vllm_fit(case, policy, out, rank)
    if case == "ddp-dynamic-fit":
        return run_dynamic_fit(case, policy, out, rank)
    if case.endswith("-fit"):
        return run_fit(case, policy, out, rank)
    strategy = _strategy(case)
    cls = VLMBatchModule if "vlm" in case.split("-") else FixedBatchModule
    module = cls(policy=policy_config(case, policy), rl=case_config(case), rollout=RolloutConfig(),
                 seed=lora_seed(case))
    module.grad_trace, module.lr = [], lr_of(case)
    if "early" in case:  # the user builds the model before fit (docs/lightning.md): nothing rank-dependent may stick
        module.configure_model()
    if "rankmean" in case:  # the wrong reduction: each rank divides by its own token count
        module.objective.dp_mean = lambda t: t
    if "nan" in case:
        module.nan_row = 1  # rank 0's second chunk (n_micro=4: one row per chunk)
    steps = 2 if "steps2" in case else 1  # loop steps, each on the same fixed batch
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, limit_train_batches=steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
    record: dict = {"case": case}
    try:
        trainer.fit(module, train_dataloaders=DataLoader([[0]] * steps, batch_size=None))
    except ValueError as err:  # the refusal case: the config error raised at setup
        if "refuse" not in case:
            raise
        record["error"] = str(err)
    else:
        record["params"] = full_params(module.policy)
        record["metrics"] = dict(module.last_metrics)
        record["sharded"] = any(hasattr(p, "full_tensor") for p in module.policy.parameters())
        record["grad_trace"] = module.grad_trace
        record["chunks"] = module.updater.last_plan.rows
        record["packed"] = module.scorer.packed
        if record["sharded"]:  # weight sync from FSDP2 shards: full tensors, gathered bucket by bucket
            engine = RecordingEngine()
            record["sync_buckets"] = push_weights(module.policy, engine, bucket_bytes=64 << 10).n_buckets
            record["pushed"] = engine.received
    torch.save(record, out / f"{case}.rank{rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--teacher", default=None, help="OPD teacher folder (opd-* cases)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # two ranks share the machine's cores
    rank, out = int(os.environ["LOCAL_RANK"]), Path(args.out)
    for case in args.cases.split(","):
        try:
            run_case(case, args.policy, out, rank, args.teacher)
        except Exception:
            (out / f"{case}.rank{rank}.err").write_text(traceback.format_exc())
            raise


if __name__ == "__main__":
    main()
