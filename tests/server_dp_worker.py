"""One rank of the 2-rank ``vllm serve`` check (tests/collect/test_async.py launches two, the way torchrun would).

Two DDP ranks (gloo) train ``TINY_JOB`` through one server that rank 0 launches; ``--k`` sets
``rollout.max_off_policy_steps``. ``--nodes 2 --placement per_node`` (under two torchrun node agents,
tests/test_nodes.py): one rank per node, each node's rank launching and syncing its own server. Writes ``<out>/rank<r>.json``: the server URLs this rank used, the weight version
it saw after each loop step, the last probe error and the rows it sent, the logged metrics and a parameter digest.

Usage: python tests/server_dp_worker.py --out DIR --policy DIR --k 0 [--nodes 2 --placement per_node]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from helpers import TINY_JOB  # tests/ is on sys.path: it is this script's folder
from lightning.pytorch import Callback, Trainer

from lightning_grpo.collect.async_rollouts import unwrapped
from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig
from lightning_grpo.correction import RolloutCorrection
from lightning_grpo.data.prompts import PromptDataModule
from lightning_grpo.data.rewards import RewardSpec
from lightning_grpo.handoff import HandoffCallback
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.rollout.server_config import ServerConfig

LOOP_STEPS = 2


class Seen(Callback):
    def __init__(self):
        self.versions, self.metrics = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = unwrapped(pl_module.engine)  # under AsyncRollouts
        self.versions.append(engine.version)
        self.metrics.append(dict(pl_module.last_metrics))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--k", type=int, default=0)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--placement", default="global")
    args = ap.parse_args()
    torch.set_num_threads(1)
    server = ServerConfig(dtype="float32", max_model_len=256, enforce_eager=True, threads=1,
                          kv_cache_memory_bytes=32 << 20, placement=args.placement)
    rl = GRPOConfig(**TINY_JOB["rl"], rollout_correction=RolloutCorrection(mode="tis"))
    module = GRPOModule(policy=PolicyConfig(path=args.policy), rl=rl, optim=OptimConfig(**TINY_JOB["optim"]),
                        rollout=RolloutConfig(engine="vllm_server", max_new_tokens=4, server=server,
                                              max_off_policy_steps=args.k),
                        rewards=[RewardSpec(**r) for r in TINY_JOB["rewards"]], seed=0)
    seen = Seen()
    trainer = Trainer(accelerator="cpu", devices=2 // args.nodes, num_nodes=args.nodes, strategy="ddp", max_steps=LOOP_STEPS * rl.steps_per_loop_step,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[seen, HandoffCallback(placement="disaggregated")])
    try:
        trainer.fit(module, datamodule=PromptDataModule("builtin:arith", val_size=0))
        engine = unwrapped(module.engine)
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in module.policy.parameters()))
        result = {"urls": [c.url for c in engine.clients], "versions": seen.versions, "launched":
                  engine.server is not None, "probe_error": engine.last_probe_error,
                  "rows": sum(c.requests for c in engine.clients), "metrics": seen.metrics,
                  "params": digest.hexdigest(), "transports": engine.transports}
        (Path(args.out) / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    finally:
        if module.engine is not None:
            module.engine.close()


if __name__ == "__main__":
    main()
