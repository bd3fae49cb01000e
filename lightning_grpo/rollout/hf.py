"""Transformers engine: rollouts drawn by ``model.generate`` on the trained policy itself.

The default engine on CPU. There is no second copy of the weights: the engine holds the
very module the optimizer updates, so a weight sync has nothing to move and sleep/wake
have nothing to free (the state is still tracked, so the hand-off order is checkable).

Sampling: ``generate`` runs its greedy loop and our last logits processor
(``rollout/sampler.py``) draws each token by inverse CDF from the row's own stream, seeded
per (prompt id, sample index); temperature, top-k and top-p are transformers' own warpers,
applied before it. Same distribution as transformers' ``multinomial`` at a fraction of its
cost, and reproducible row by row.

Sampler logprobs (``SamplingConfig.logprobs``) are exactly what the sampler drew from:
``log_softmax`` of the logits after temperature scaling and top-k/top-p masking, gathered
at the drawn token. With ``top_p=1`` and ``top_k=0`` that is ``log_softmax(logits / T)``,
the quantity the update scores at the same temperature; with a nucleus or top-k it is
renormalized over the kept tokens; greedy (``temperature=0``) gives ``log_softmax(logits)``.
vLLM's ``processed_logprobs`` mode returns the same quantity (see ``rollout/vllm.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor, nn

from lightning_grpo.distributed import is_fsdp2
from lightning_grpo.rollout.base import (
    Prompt,
    Rollout,
    SamplingConfig,
    VocabDraw,
    cut_at_stop,
    cut_before_forbidden,
)
from lightning_grpo.rollout.gqa import decode_attention
from lightning_grpo.rollout.sampler import InverseCDFSampler, RowStreams, row_seeds
from lightning_grpo.rollout.sleep import BookkeptSleep, SleepState
from lightning_grpo.rollout.weight_sync import named_weights


class HFEngine(BookkeptSleep):
    """Draws rollouts with transformers ``generate`` on the policy module itself (no copy).

    Args:
        model: the policy (a transformers causal LM), on the device it trains on.
        tokenizer: its tokenizer (pad/eos ids, decoding).
        eos_token_ids: token ids that end a completion; None = the tokenizer's EOS plus the
            model's ``generation_config.eos_token_id``.
        vision: a vision-language policy's ``VisionProcessor``: prompts with images generate from their pixels
            (decoded for this call only). None = a text-only policy (image prompts are refused).
        grouped_attention: decode a grouped-query policy on CPU without copying its KV heads (``rollout/gqa.py``;
            same tokens, measurably faster). False keeps transformers' ``sdpa`` path (for side-by-side benches).

    Example::

        engine = HFEngine(model, tokenizer)
        rollouts = engine.generate(prompts, group_size=8, sampling=SamplingConfig(seed=step))
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        eos_token_ids: Sequence[int] | None = None,
        vision=None,
        grouped_attention: bool = True,
    ) -> None:
        self.model = model
        self.grouped_attention = grouped_attention
        self.vision = vision
        self.tokenizer = tokenizer
        self.eos_token_ids = (
            list(eos_token_ids)
            if eos_token_ids is not None
            else _default_eos(model, tokenizer)
        )
        if not self.eos_token_ids:
            raise ValueError(
                "HFEngine(eos_token_ids=None): the tokenizer and model define no EOS; pass eos_token_ids"
            )
        pad = tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.eos_token_ids[0]
        self._sleep = SleepState()

    # -- generation ----------------------------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingConfig
    ) -> list[Rollout]:
        """``group_size`` completions per prompt, prompt 0's group first, drawn in one batched call."""
        self._sleep.require("weights", "kv_cache", call="HFEngine.generate()")
        self._check_prompts(prompts, sampling)
        rows = [p for p in prompts for _ in range(group_size)]
        # [N, L]
        input_ids, attention_mask = self._left_pad([p.token_ids for p in rows])
        streams = RowStreams(
            row_seeds([p.id for p in prompts], group_size, sampling.seed)
        )
        sampler = InverseCDFSampler(
            streams if sampling.temperature > 0 else None, record=sampling.logprobs
        )
        # Pixels of this call's prompts only, repeated for each prompt's group; dropped when generate returns.
        vision = (
            self.vision.for_generation(prompts, group_size, input_ids)
            if self.vision is not None
            else None
        )
        with (
            self._generation_mode(),
            decode_attention(self.model, self.grouped_attention),
        ):
            # [N, L + T]
            sequences = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                **(
                    {}
                    if vision is None
                    else {
                        k: v.to(input_ids.device) for k, v in vision.as_kwargs().items()
                    }
                ),
                generation_config=self._generation_config(sampling),
                logits_processor=_processors(sampling, sampler),
                stopping_criteria=_stop_criteria(
                    self.tokenizer, sampling.stop, input_ids.shape[1]
                ),
                # FSDP2: every forward is a collective, so ranks keep stepping until all have finished.
                synced_gpus=_fsdp2_sharded(self.model) or None,
            )
        completions = sequences[:, input_ids.shape[1] :].cpu()  # [N, T]
        logprobs = sampler.logprobs().cpu() if sampling.logprobs else None  # [N, T]
        return [
            self._rollout(
                p,
                completions[i],
                None if logprobs is None else logprobs[i],
                sampling.stop,
                sampling.forbidden_token_ids,
            )
            for i, p in enumerate(rows)
        ]

    def vocabulary_logprobs(
        self, prompts: Sequence[Prompt], max_new_tokens: int, seed: int
    ) -> list[VocabDraw]:
        """One completion per prompt at temperature 1, and the log-softmax of the logits each token was drawn from
        (the decode path: left-padded batch, KV cache, this engine's attention), ``[T, V]`` float32 per prompt."""
        self._sleep.require(
            "weights", "kv_cache", call="HFEngine.vocabulary_logprobs()"
        )
        sampling = SamplingConfig(max_new_tokens=max_new_tokens, seed=seed)
        self._check_prompts(prompts, sampling)
        # [N, L]
        input_ids, attention_mask = self._left_pad([p.token_ids for p in prompts])
        sampler = InverseCDFSampler(
            RowStreams(row_seeds([p.id for p in prompts], 1, seed)), record=False
        )
        config = self._generation_config(sampling)
        # the logits before any processor: the model's own distribution at T = 1
        config.output_logits = True
        config.return_dict_in_generate = True
        with (
            self._generation_mode(),
            decode_attention(self.model, self.grouped_attention),
        ):
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                logits_processor=_processors(sampling, sampler),
            )
        # [N, T, V]
        logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1).cpu()
        completions = out.sequences[:, input_ids.shape[1] :].cpu()  # [N, T]
        draws = []
        for i, p in enumerate(prompts):
            # EOS kept, padding after it dropped
            ids = self._rollout(p, completions[i], None, ()).token_ids
            draws.append(VocabDraw(ids, logprobs[i, : len(ids)]))
        return draws

    def _check_prompts(
        self, prompts: Sequence[Prompt], sampling: SamplingConfig
    ) -> None:
        n_ctx = getattr(
            getattr(self.model, "config", None), "max_position_embeddings", None
        )
        for p in prompts:
            if not p.token_ids:
                raise ValueError(
                    f"prompt id={p.id} has no tokens; a completion needs a non-empty prompt"
                )
            if p.images and self.vision is None:
                raise ValueError(
                    f"prompt id={p.id} has {len(p.images)} images but the policy is text-only; use a "
                    "vision-language policy (e.g. Qwen2.5-VL) for image prompts"
                )
            if n_ctx is not None and len(p.token_ids) + sampling.max_new_tokens > n_ctx:
                raise ValueError(
                    f"prompt id={p.id}: {len(p.token_ids)} prompt tokens + max_new_tokens={sampling.max_new_tokens} "
                    f"exceed the model context max_position_embeddings={n_ctx}; shorten the prompt or max_new_tokens"
                )

    def _left_pad(self, token_lists: list[list[int]]) -> tuple[Tensor, Tensor]:
        device = _device_of(self.model)
        width = max(len(t) for t in token_lists)
        ids = torch.full((len(token_lists), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(token_lists), width, dtype=torch.long)
        for i, toks in enumerate(token_lists):
            ids[i, width - len(toks) :] = torch.tensor(toks, dtype=torch.long)
            mask[i, width - len(toks) :] = 1
        return ids.to(device), mask.to(device)

    def _generation_config(self, sampling: SamplingConfig):
        from transformers import GenerationConfig

        # Greedy loop: our processors warp the scores and draw the token (InverseCDFSampler), generate's argmax
        # then picks it. transformers adds its own warpers (top_k=50 by default) only when do_sample is on.
        return GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_ids,
            do_sample=False,
        )

    @contextlib.contextmanager
    def _generation_mode(self) -> Iterator[None]:
        """eval + no_grad and a neutral generation_config (the draw's randomness is the sampler's own streams)."""
        from transformers import GenerationConfig

        model = self.model
        was_training = model.training
        saved_config = getattr(model, "generation_config", None)
        # The checkpoint's generation_config.json (top_k, repetition_penalty, ...) would otherwise fill any
        # field we leave unset: the draw must follow SamplingConfig and nothing else.
        model.generation_config = GenerationConfig()
        model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            model.train(was_training)
            model.generation_config = saved_config

    def _rollout(
        self,
        prompt: Prompt,
        tokens: Tensor,
        logprobs: Tensor | None,
        stop: Sequence[str],
        forbidden: Sequence[int] = (),
    ) -> Rollout:
        ids, _ = cut_before_forbidden(tokens.tolist(), forbidden)
        eos = next((j for j, t in enumerate(ids) if t in self.eos_token_ids), None)
        # EOS included; padding after it dropped
        ids = ids if eos is None else ids[: eos + 1]
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        ids, text, stopped = (
            cut_at_stop(ids, stop, decode) if stop else (ids, decode(ids), False)
        )
        return Rollout(
            prompt=prompt,
            token_ids=ids,
            text=text,
            # both lie before a forbidden token
            finish_reason="stop" if stopped or eos is not None else "length",
            logprobs=None if logprobs is None else logprobs[: len(ids)].tolist(),
        )

    # hand-off hooks: sleep, wake_up, asleep from BookkeptSleep (nothing of this process's to free or move)
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy tensors into the policy by name; the policy's own tensors (the usual case) are skipped."""
        self._sleep.require("weights", call="HFEngine.load_weights()")
        for name, tensor in named_tensors:
            target = _named_tensor(self.model, name)
            if _same_storage(target, tensor):
                continue
            target.copy_(tensor)

    def reset_prefix_cache(self) -> None:
        """Nothing cached across calls: transformers builds a fresh KV cache per ``generate``."""

    def weight_names(self) -> list[str]:
        """Every parameter and persistent buffer the engine generates with (what a full sync must rewrite)."""
        return [name for name, _ in named_weights(self.model)]


def _processors(sampling: SamplingConfig, sampler: InverseCDFSampler):
    from transformers import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = LogitsProcessorList()
    if sampling.temperature > 0:  # vLLM's order: temperature, top-k, top-p
        if sampling.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k > 0:
            procs.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            procs.append(TopPLogitsWarper(sampling.top_p))
    procs.append(sampler)  # last: draws from exactly what the warpers left
    return procs


class _StopStrings:
    """Stopping criterion: a row is done once its *completion* text holds a stop string (never the prompt's).

    transformers' own ``stop_strings`` also match a stop string straddling the prompt's end, where vLLM only
    looks at the completion; this one looks where vLLM looks. It decodes only each row's last few tokens.
    """

    def __init__(self, tokenizer, stop: Sequence[str], prompt_width: int) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.start = prompt_width
        # tokens that can spell the longest stop string
        self.window = max(len(s) for s in self.stop) + 4

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs) -> Tensor:
        tails = input_ids[:, self.start :][:, -self.window :].tolist()
        texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in tails]
        return torch.tensor(
            [any(s in t for s in self.stop) for t in texts], device=input_ids.device
        )


def _stop_criteria(tokenizer, stop: Sequence[str], prompt_width: int):
    from transformers import StoppingCriteriaList

    return StoppingCriteriaList(
        [_StopStrings(tokenizer, stop, prompt_width)] if stop else []
    )


def _default_eos(model: nn.Module, tokenizer) -> list[int]:
    ids = [tokenizer.eos_token_id]
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    ids += extra if isinstance(extra, (list, tuple)) else [extra]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _fsdp2_sharded(model: nn.Module) -> bool:
    return (
        is_fsdp2(model)
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _named_tensor(model: nn.Module, name: str) -> Tensor:
    try:
        return model.get_parameter(name)
    except AttributeError:
        pass
    try:
        return model.get_buffer(name)
    except AttributeError:
        raise ValueError(
            f"load_weights: the policy has no parameter or buffer named {name!r}"
        ) from None


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return (
        a.device == b.device
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.data_ptr() == b.data_ptr()
    )
