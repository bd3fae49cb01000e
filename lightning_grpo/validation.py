"""Validation during fit: held-out prompts, one greedy completion each, scored by the run's rewards.

With ``model.env`` each held-out prompt plays one greedy episode instead (the training episode path, its limits and
parser), scored by the environment's reward; its ``tools/*`` and ``episode/*`` metrics come as ``val/tools/*`` and
``val/episode/*``, and ``val/len_mean`` counts the model's tokens only.

``GRPOModule.validation_step`` hands each held-out batch (``PromptDataModule.val_dataloader``) to
``greedy_scores``. Completions come from the module's own rollout engine, so validation measures
exactly the policy the engine holds. The hand-off Callback publishes the trainer's weights in its
``on_validation_start`` (the engine is stale after an update), so the engine is awake and current
when the first validation batch generates; an engine still asleep refuses to generate.

When it runs: Lightning's ``val_check_interval`` counts training batches, and under manual
optimization one batch is one loop step, so ``trainer.val_check_interval: 10`` validates every 10
loop steps whatever ``n_mini`` is. The draw is seeded on a private RNG stream, so validating does
not change the training run's rollouts.

With ``data.val_samples_per_prompt = k > 0`` each held-out prompt also gets k completions sampled at the training
temperature (one seed for every validation, so two validations differ only by the policy): ``val/pass@k`` is the
unbiased estimator of Chen et al. 2021 (arXiv 2107.03374, eq. 1) with n = k draws, ``val/pass@1`` its k = 1 value
(the share of draws that pass), ``val/mean@k`` the mean total reward of the draws. A draw passes when its total
reward is at least ``data.val_pass_reward``. Greedy ``val/reward`` says what the policy prefers; pass@k says what
it can find, which is what GRPO's group sampling learns from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from lightning_grpo.collect import Collector
from lightning_grpo.collect.prompts import live_prompts
from lightning_grpo.rollout.base import SamplingConfig

VAL_SEED = 0
"""Seed of the validation draw (greedy needs none; it keeps the engines off the global RNG)."""


def is_measurement(trainer) -> bool:
    """Whether the validation now ending is one the run reports (logged as a metrics row, summarized, plotted).

    Every regular validation is. Lightning's sanity check is when it ran every held-out batch
    (``trainer.num_sanity_val_steps: -1``): it then measured the weights training starts from (loop step 0; Lightning
    runs none when a fit resumes mid-epoch). Lightning itself logs nothing during a sanity check;
    ``UpdateModule.on_validation_end`` writes that row.
    """
    return not trainer.sanity_checking or sum(trainer.num_sanity_val_batches) >= sum(
        trainer.num_val_batches
    )


def greedy_sampling(max_new_tokens: int) -> SamplingConfig:
    """Greedy decoding (temperature 0) with the training completion cap."""
    return SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0, seed=VAL_SEED)


def greedy_scores(
    collector: Collector,
    records: Sequence,
    loop_step: int,
    samples_per_prompt: int = 0,
    pass_reward: float = 1.0,
) -> dict[str, float]:
    """``val/*`` metrics of one held-out batch: one greedy completion per prompt, scored as training scores.

    Args:
        collector: the run's collector (its engine, prompt encoding, sampling and rewards are used).
        records: this rank's ``PromptRecord``s of one validation batch.
        loop_step: loop steps trained so far (the training sampling's stop strings and forbidden tokens).
        samples_per_prompt: ``data.val_samples_per_prompt`` (k > 0 adds ``val/pass@k``; ``sampled_scores``).
        pass_reward: ``data.val_pass_reward``, the total reward at which a sampled draw passes.

    Returns:
        ``val/reward`` (mean total reward), ``val/<name>`` for each reward part ``reward/<name>``,
        ``val/len_mean`` (completion tokens) and ``val/stop_frac`` (share that ended on EOS); with ``model.env``
        also ``val/tools/*`` and ``val/episode/*`` of the greedy episodes.
    """
    # The encoding training uses (a VLM's image placeholders expanded); unreadable images as data.on_bad_record says.
    prompts = live_prompts(*collector.prompts_of(records))
    # its stop strings end turns (an episode's calls) and completions
    train = collector.sampling.at(loop_step)
    sampling = replace(
        greedy_sampling(train.max_new_tokens),
        stop=train.stop,
        forbidden_token_ids=train.forbidden_token_ids,
    )
    # with model.env: whole episodes
    rollouts, episodes = collector.draw(prompts, 1, sampling)
    rewards, parts = collector.score(rollouts)
    metrics = {"val/reward": float(rewards.float().mean())}
    metrics.update(
        {f"val/{name}": value for name, value in {**parts, **episodes}.items()}
    )
    metrics["val/len_mean"] = sum(_model_tokens(r) for r in rollouts) / len(rollouts)
    metrics["val/stop_frac"] = sum(r.finish_reason == "stop" for r in rollouts) / len(
        rollouts
    )
    if samples_per_prompt > 0 and prompts:
        metrics.update(
            sampled_scores(collector, prompts, samples_per_prompt, pass_reward, train)
        )
    return metrics


def sampled_scores(
    collector: Collector,
    prompts: Sequence,
    k: int,
    pass_reward: float,
    train: SamplingConfig,
) -> dict[str, float]:
    """``val/pass@k``, ``val/pass@1``, ``val/mean@k`` of ``k`` completions per prompt at the training temperature
    (``train``: the training sampling)."""
    # the same draw at every validation
    sampling = replace(train, seed=VAL_SEED, logprobs=False)
    rewards, _ = collector.score(collector.draw(prompts, k, sampling)[0])
    grouped = rewards.float().view(len(prompts), k)  # [P, k]
    passed = (grouped >= pass_reward).sum(dim=1)  # [P]
    return {
        "val/pass@k": sum(pass_at_k(k, int(c), k) for c in passed) / len(prompts),
        "val/pass@1": float(passed.float().mean() / k),
        "val/mean@k": float(grouped.mean()),
    }


def _model_tokens(rollout) -> int:
    """Tokens the policy wrote (an episode's tool results are not its own), as ``completion/len_*`` counts them."""
    return (
        len(rollout.token_ids)
        if rollout.model_mask is None
        else sum(rollout.model_mask)
    )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` draws of which ``c`` pass: ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(
            f"pass_at_k(n={n}, c={c}, k={k}): needs 0 <= c <= n and 1 <= k <= n"
        )
    # exact integers: no float cancellation for large n
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class ValidationMeans(nn.Module):
    """Epoch means of the ``val/*`` metrics: one torchmetrics ``MeanMetric`` per name, weighted by prompts.

    Not ``self.log(..., sync_dist=True)``: an in-process vLLM engine starts a (world size 1)
    ``torch.distributed`` group in a single-process run, Lightning then drops ``sync_dist`` (its strategy
    is not distributed) and warns at every validation that the epoch value is not synced. A ``Metric``
    syncs itself over whatever group exists, so one process and several ranks log the same mean.
    """

    def __init__(self) -> None:
        super().__init__()
        self.means = nn.ModuleDict()
        # metric name -> ModuleDict key (names hold '/' and '.')
        self._keys: dict[str, str] = {}

    def add(
        self, metrics: dict[str, float], weight: int, device: torch.device
    ) -> list[tuple[str, nn.Module, str]]:
        """Add one validation batch of ``weight`` prompts. Returns ``(name, mean, attribute)`` per metric, for the
        module to log at epoch level (``self.log(name, mean, metric_attribute=attribute)``)."""
        from torchmetrics import MeanMetric

        out = []
        for name, value in metrics.items():
            if name not in self._keys:
                self._keys[name] = f"m{len(self._keys)}"
                self.means[self._keys[name]] = MeanMetric().to(device)
            key = self._keys[name]
            self.means[key].update(value, weight)
            out.append((name, self.means[key], f"val_means.means.{key}"))
        return out

    def names(self) -> list[str]:
        """The metric names logged so far (``step`` among them)."""
        return list(self._keys)
