"""An ordinary Lightning project, before GRPO: a small causal LM fine-tuned (SFT) to reverse words.

Nothing here knows about lightning-grpo. It stands for the code a team already has: its own
tokenizer and model construction, its own LightningModule and data, its own Trainer setup with
callbacks and a logger. ``grpo.py`` adds GRPO fine-tuning on top with a few lines.

The task: ``"abc="`` -> ``"cba"`` (lowercase words of 3-4 letters), exact match.
"""

from __future__ import annotations

import random

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

LETTERS = "abcdefghijklmnopqrstuvwxyz"
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


# -- the project's own model construction -------------------------------------------------------------------------


def build_tokenizer():
    """A character tokenizer (stands in for ``AutoTokenizer.from_pretrained(...)``; nothing is downloaded)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *LETTERS, "="])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


def build_model(tokenizer, seed: int = 0):
    """A small Llama-architecture causal LM, initialized from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


# -- the task: data and the exact-match score ---------------------------------------------------------------------


def reverse_pairs(n: int, seed: int) -> list[dict]:
    """``n`` rows ``{"prompt": "abc=", "answer": "cba"}`` drawn from ``seed``."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 4))) for _ in range(n)]
    return [{"prompt": f"{w}=", "answer": w[::-1]} for w in words]


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion is exactly the answer, else 0.0."""
    return float(completion.strip() == answer)


class ReverseSFTData(L.LightningDataModule):
    """Teacher-forced ``prompt + answer + <eos>`` rows; the loss covers the answer only."""

    def __init__(self, tokenizer, size: int = 2048, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.tokenizer, self.rows, self.batch_size = tokenizer, reverse_pairs(size, seed), batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.rows, batch_size=self.batch_size, shuffle=True, collate_fn=self._collate)

    def _collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        tok, ids, labels = self.tokenizer, [], []
        for row in rows:
            prompt = tok(row["prompt"])["input_ids"]
            answer = tok(row["answer"])["input_ids"] + [tok.eos_token_id]
            ids.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
        width = max(map(len, ids))
        pad = lambda xs, v: [x + [v] * (width - len(x)) for x in xs]
        input_ids = torch.tensor(pad(ids, tok.pad_token_id))  # [B, T]
        return {"input_ids": input_ids, "attention_mask": input_ids != tok.pad_token_id,
                "labels": torch.tensor(pad(labels, -100))}


class CausalLMSFT(L.LightningModule):
    """Supervised fine-tuning of the project's causal LM (automatic optimization, the usual way)."""

    def __init__(self, lr: float = 3e-3, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tokenizer = build_tokenizer()
        self.model = build_model(self.tokenizer, seed)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("sft/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.hparams.lr)


# -- the project's Trainer setup ----------------------------------------------------------------------------------


def make_trainer(root: str, name: str, max_steps: int, callbacks: list | None = None, **kwargs) -> L.Trainer:
    """The team's Trainer: CSV logs and checkpoints under ``root/name``, LR monitoring, their defaults."""
    return L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=CSVLogger(root, name=name),
        callbacks=[ModelCheckpoint(save_last=True), LearningRateMonitor(logging_interval="step"), *(callbacks or [])],
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def train_sft(root: str, steps: int) -> str:
    """Fine-tune from scratch; returns the path of the last checkpoint."""
    L.seed_everything(0)
    module = CausalLMSFT()
    trainer = make_trainer(root, "sft", max_steps=steps, log_every_n_steps=10)
    trainer.fit(module, datamodule=ReverseSFTData(module.tokenizer))
    return trainer.checkpoint_callback.last_model_path
