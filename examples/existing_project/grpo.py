"""GRPO fine-tuning added to the project in ``project.py``: the lines a team writes.

1. Subclass ``GRPOModule``: build the policy the project's way (its SFT checkpoint) and score
   completions with the project's own reward.
2. Give the project's own Trainer the hand-off Callback, and log every loop step.
3. Feed prompts from a ``PromptDataModule`` over the project's rows (held-out rows validate).

    python examples/existing_project/grpo.py                       # SFT, then GRPO (CPU, a few minutes)
    python examples/existing_project/grpo.py --sft-steps 2 --loop-steps 2 --val-every 2   # a smoke run
    python examples/existing_project/grpo.py --loop-steps 40 \
        --ckpt-path runs/existing_project/grpo/version_0/checkpoints/last.ckpt   # resume: exact, from any
                                                                                # checkpoint Lightning wrote
"""

from __future__ import annotations

import argparse

import lightning.pytorch as L  # the namespace lightning-grpo supports (not the `pytorch_lightning` alias)
import torch
from project import CausalLMSFT, exact_match, make_trainer, reverse_pairs, train_sft  # the script's own folder

from lightning_grpo import GRPOConfig, GRPOModule, HandoffCallback, OptimConfig, PromptDataModule, RolloutConfig


class ReverseGRPO(GRPOModule):
    """GRPO on the project's model (from its SFT checkpoint), rewarded by the project's exact match."""

    def __init__(self, sft_checkpoint: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sft_checkpoint = sft_checkpoint

    def configure_policy(self):  # called by configure_model, on each rank, when the Trainer sets the module up
        sft = CausalLMSFT.load_from_checkpoint(self.sft_checkpoint) if self.sft_checkpoint else CausalLMSFT()
        return sft.model, sft.tokenizer

    def compute_rewards(self, rollouts):
        rewards = torch.tensor([exact_match(r.text, r.prompt.answer) for r in rollouts])  # [N]
        return rewards, {"reward/exact_match": float(rewards.mean())}


def train_grpo(root: str, sft_checkpoint: str | None, loop_steps: int, val_every: int,
               ckpt_path: str | None = None) -> L.Trainer:
    """GRPO with the project's Trainer setup; ``max_steps`` counts optimizer steps = loop steps x n_mini.

    ``ckpt_path``: resume from a checkpoint the project's own ``ModelCheckpoint`` wrote; the module saves its
    loop state in every checkpoint, so the continuation equals an uninterrupted run.
    """
    L.seed_everything(0)
    module = ReverseGRPO(sft_checkpoint, rl=GRPOConfig(batch_per_replica=32, group_size=8, mini_batch_per_replica=16),
                         optim=OptimConfig(lr=1e-3), rollout=RolloutConfig(max_new_tokens=6))
    data = PromptDataModule(source=reverse_pairs(4096, seed=1), val_source=reverse_pairs(32, seed=2), val_size=32)
    trainer = make_trainer(root, "grpo", max_steps=loop_steps * module.rl.n_mini, callbacks=[HandoffCallback()],
                           log_every_n_steps=1, val_check_interval=val_every)  # both count loop steps
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def main(argv: list[str] | None = None) -> L.Trainer:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="runs/existing_project", help="logs and checkpoints go here")
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--loop-steps", type=int, default=20, help="GRPO loop steps (collected batches)")
    parser.add_argument("--val-every", type=int, default=5, help="validate (greedy, held-out) every N loop steps")
    parser.add_argument("--ckpt-path", help="resume GRPO from this checkpoint (e.g. .../checkpoints/last.ckpt)")
    args = parser.parse_args(argv)
    sft_checkpoint = train_sft(args.root, args.sft_steps)
    trainer = train_grpo(args.root, sft_checkpoint, args.loop_steps, args.val_every, args.ckpt_path)
    val = trainer.callback_metrics.get("val/reward")
    print(f"SFT checkpoint {sft_checkpoint}\nGRPO logs {trainer.log_dir} (draw: lightning-grpo plot {trainer.log_dir})"
          + ("" if val is None else f"\nval/reward {float(val):.3f} (greedy, held-out)"))
    return trainer


if __name__ == "__main__":
    main()
