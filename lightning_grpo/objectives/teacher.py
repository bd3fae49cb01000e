"""Teachers for on-policy distillation: they score the student's own tokens and never train.

* ``HFTeacher``: a Hugging Face causal LM loaded like the policy (``PolicyConfig``), in its own dtype,
  frozen, in eval mode, optionally on another device. It gives per-token logprobs of the sampled
  tokens and its whole distribution at the completion positions (for the full-vocabulary KL).
* ``VLLMTeacher``: an in-process vLLM engine on the teacher's folder that returns *prompt logprobs*
  of the student's sequences (one prefill, ``max_tokens=1``), i.e. the sampled-token logprobs only.

The teacher is kept out of the LightningModule's children on purpose: Lightning's precision plugin
does not cast it, the strategy does not wrap or shard it, and checkpoints do not carry it.
Teachers score at temperature 1 (their own distribution; vLLM's prompt logprobs are raw as well).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_grpo.batch import RolloutBatch
from lightning_grpo.logprobs import token_logprobs
from lightning_grpo.objectives.kl import at_least_float32, completion_hidden
from lightning_grpo.policy import PolicyConfig, load_policy, resolve_path


class VocabularyMismatchError(ValueError):
    """The teacher does not share the student's tokenizer (or, for the full KL, its vocabulary size)."""


def model_vocab_size(model: nn.Module) -> int:
    """Rows of the model's LM head (the ``V`` of its logits)."""
    head = (
        model.get_output_embeddings()
        if hasattr(model, "get_output_embeddings")
        else None
    )
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


def check_same_vocab(
    student_vocab: int,
    student_tok,
    teacher_vocab: int,
    teacher_tok,
    need_same_size: bool,
) -> None:
    """Refuse a teacher whose tokenizer differs from the student's, naming both sizes.

    Distillation scores the *student's token ids* with the teacher, so both must read ids the same way.
    The full-vocabulary KL also compares the distributions entry by entry: the heads must be the same size.
    """
    sizes = (
        f"teacher vocabulary {len(teacher_tok)} tokens (LM head {teacher_vocab}), student {len(student_tok)} "
        f"tokens (LM head {student_vocab})"
    )
    if teacher_tok.get_vocab() != student_tok.get_vocab():
        raise VocabularyMismatchError(
            f"opd.teacher: its tokenizer differs from the student's ({sizes}). On-policy distillation scores the "
            "student's sampled token ids with the teacher, so both models must share one tokenizer; pick a teacher "
            "of the student's model family"
        )
    if need_same_size and teacher_vocab != student_vocab:
        raise VocabularyMismatchError(
            f"opd.teacher: LM head sizes differ ({sizes}); opd.kl=full compares the two distributions entry by "
            "entry. Use opd.kl=sampled (it reads only the sampled token's logprob), or a teacher with the same "
            "vocabulary size"
        )


class HFTeacher:
    """A frozen Hugging Face teacher.

    Args:
        config: where and how to load it (path, dtype, ...; ``warm_start`` works for a ``tiny:`` teacher too).
        device: where it runs; None = where the student's chunk is (moved there on first use).

    Example::

        teacher = HFTeacher(PolicyConfig(path="Qwen/Qwen2.5-7B-Instruct", dtype="bfloat16"), device="cuda:1")
        lp = teacher.token_logprobs(chunk)  # [B, T-1] on the chunk's device
    """

    def __init__(self, config: PolicyConfig, device: str | None = None) -> None:
        model, self.tokenizer = load_policy(config)
        self.model = model.eval().requires_grad_(False)
        self.device = torch.device(device) if device is not None else None
        if self.device is not None:
            self.model.to(self.device)

    @property
    def vocab_size(self) -> int:
        return model_vocab_size(self.model)

    def _place(self, like: Tensor) -> torch.device:
        # follow the student (Lightning moves it after configure_model)
        if self.device is None:
            self.device = like.device
            self.model.to(self.device)
        return self.device

    @torch.no_grad()
    def token_logprobs(self, chunk: RolloutBatch) -> Tensor:
        """``[B, T-1]`` teacher logprobs of the chunk's tokens at the completion positions (0 elsewhere)."""
        device = self._place(chunk.input_ids)
        mask = chunk.completion_mask[:, 1:]
        lp = token_logprobs(
            self.model, chunk.input_ids.to(device), chunk.attention_mask.to(device)
        )
        return lp.to(chunk.input_ids.device).masked_fill(~mask, 0.0)

    @torch.no_grad()
    def completion_hidden(self, chunk: RolloutBatch) -> Tensor:
        """``[N, H]`` final hidden states at the completion positions, on the teacher's device."""
        device = self._place(chunk.input_ids)
        mask = chunk.completion_mask[:, 1:].to(device)
        return completion_hidden(
            self.model,
            chunk.input_ids.to(device),
            chunk.attention_mask.to(device),
            mask,
        )

    @torch.no_grad()
    def distribution(self, hidden: Tensor) -> Tensor:
        """``[c, V]`` float32 (or wider) log-probabilities from ``[c, H]`` hidden states (one chunk of positions)."""
        return torch.log_softmax(
            at_least_float32(self.model.get_output_embeddings()(hidden)), dim=-1
        )


class VLLMTeacher:
    """A teacher served by an in-process vLLM engine: prompt logprobs of the student's sequences.

    Args:
        config: the teacher's folder (``tiny:`` builds one, as for the policy).
        vllm: engine knobs (``VLLMConfig``; float32 on CPU keeps it equal to the HF teacher to ~1e-5).
    """

    def __init__(self, config: PolicyConfig, vllm=None) -> None:
        from transformers import AutoConfig, AutoTokenizer

        # Only a vLLM teacher loads the vLLM engine module (no circle: rollout.vllm imports no objective).
        from lightning_grpo.rollout.vllm import VLLMEngine

        path = resolve_path(config)
        self.tokenizer = AutoTokenizer.from_pretrained(
            path, trust_remote_code=config.trust_remote_code
        )
        self.vocab_size = int(
            AutoConfig.from_pretrained(
                path, trust_remote_code=config.trust_remote_code
            ).vocab_size
        )
        self.engine = VLLMEngine(path, vllm)

    def token_logprobs(self, chunk: RolloutBatch) -> Tensor:
        """``[B, T-1]`` teacher logprobs of the chunk's tokens at the completion positions (0 elsewhere)."""
        from vllm import SamplingParams

        ids = chunk.input_ids.tolist()
        lengths = chunk.attention_mask.sum(-1).tolist()
        requests = [{"prompt_token_ids": row[:n]} for row, n in zip(ids, lengths)]
        outs = self.engine.llm.generate(
            requests, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
        )
        lp = torch.zeros(
            chunk.input_ids.shape[0], chunk.input_ids.shape[1] - 1, dtype=torch.float32
        )
        for i, (out, row, n) in enumerate(zip(outs, ids, lengths)):
            # prompt_logprobs[t] holds log p(token t | tokens < t); entry 0 is None (nothing predicts token 0)
            lp[i, : n - 1] = torch.tensor(
                [
                    step[tok].logprob
                    for step, tok in zip(out.prompt_logprobs[1:n], row[1:n])
                ]
            )
        mask = chunk.completion_mask[:, 1:]
        return lp.to(chunk.input_ids.device).masked_fill(~mask, 0.0)

    def close(self) -> None:
        self.engine.close()
