"""``build_engine``: the rollout engine ``rollout.engine`` names, built from explicit parts (``EngineParts``).

Above ``rollout/``, not in it: resolving the policy folder needs ``policy.py`` and decoding a VLM's images needs
``data/images.py``, and ``rollout/`` imports neither. The parts come from whoever owns them (``GRPOModule.build_engine``
fills them from its policy, tokenizer and ``rl`` section); nothing here reads a LightningModule.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

from lightning.pytorch import Trainer
from torch import nn

from lightning_grpo.config import GRPOConfig
from lightning_grpo.data.images import load_images
from lightning_grpo.policy import PolicyConfig, resolve_path
from lightning_grpo.rollout import adapter_sync
from lightning_grpo.rollout.base import RolloutEngine
from lightning_grpo.rollout.hf import HFEngine
from lightning_grpo.rollout.replay import ReplayEngine
from lightning_grpo.rollout.rollout_config import RolloutConfig
from lightning_grpo.rollout.server.ranks import Ranks
from lightning_grpo.rollout.server_config import ServerConfig
from lightning_grpo.rollout.vllm_config import VLLMConfig
from lightning_grpo.rollout.vllm_loadable import check_vllm_can_load
from lightning_grpo.vision import VisionProcessor


@dataclass(frozen=True)
class EngineParts:
    """What an engine is built from, besides the ``rollout`` section.

    ``GRPOModule.build_engine`` fills these from its policy, tokenizer, ``policy`` and ``rl`` sections and its trainer.
    """

    policy: nn.Module
    """The trained policy: ``HFEngine`` generates with it; a server's syncs are probed against its logprobs."""
    tokenizer: object
    """The policy's tokenizer (its EOS id, and decoding a server's completions)."""
    policy_cfg: PolicyConfig
    """The ``policy`` section: the folder a vLLM engine loads (resolved only for one) and its LoRA."""
    rl: GRPOConfig
    """The ``rl`` section: whether the run consumes sampler logprobs, and the correction mode that needs them."""
    vision: VisionProcessor | None = None
    """A vision-language policy's image side (``HFEngine``); None for a text-only policy."""
    trainer: Trainer | None = None
    """The fit it is built in (its global and local rank start vLLM's ``external_launcher``); None outside a fit."""

    @property
    def sampler_logprobs(self) -> bool:
        """The run consumes sampler logprobs (``rl.needs_sampler_logprobs``)."""
        return self.rl.needs_sampler_logprobs

    @property
    def lora_rank(self) -> int | None:
        """The LoRA rank an engine serves adapters of (``policy.lora.sync=adapter``); None: merged weights."""
        lora = self.policy_cfg.lora
        return lora.rank if lora is not None and lora.sync == "adapter" else None


def build_engine(
    cfg: RolloutConfig, parts: EngineParts, will_sleep: bool = True
) -> RolloutEngine:
    """The engine ``cfg.engine`` names, bound to ``parts``' policy and tokenizer.

    ``will_sleep=False`` (nothing will put the engine to sleep: ``colocated_offload=false``, disaggregated, or
    no hand-off at all) builds a vLLM engine without sleep mode, which then reserves no memory for it, unless
    ``vllm.enable_sleep_mode`` is set explicitly. ``cfg`` itself is never changed.
    """
    if cfg.engine == "replay":
        need = (
            f"rl.rollout_correction.mode={parts.rl.rollout_correction.mode!r}"
            if parts.sampler_logprobs
            else None
        )
        return ReplayEngine(
            cfg.replay_path,
            eos_token_id=parts.tokenizer.eos_token_id,
            need_logprobs=need,
        )
    if cfg.engine == "hf":
        return HFEngine(parts.policy, parts.tokenizer, vision=parts.vision)
    if cfg.engine == "vllm":
        return _vllm_engine(cfg, parts, will_sleep)
    if cfg.engine == "vllm_server":
        return _server_engine(cfg, parts)
    raise ValueError(
        f"rollout.engine={cfg.engine!r}: must be one of 'hf', 'vllm', 'vllm_server', 'replay'"
    )


def _vllm_engine(
    cfg: RolloutConfig, parts: EngineParts, will_sleep: bool
) -> RolloutEngine:
    """An in-process ``vllm.LLM`` on the policy's folder."""
    # Deferred: `import lightning_grpo.engines` (every GRPOModule does) never loads the vLLM engine module (and vLLM's
    # own imports) unless a vLLM engine is built.
    from lightning_grpo.rollout.vllm import VLLMEngine

    vllm = cfg.vllm or VLLMConfig()
    # an explicit choice is the user's
    if vllm.enable_sleep_mode is None and not will_sleep:
        vllm = replace(vllm, enable_sleep_mode=False)
    if (
        vllm.distributed_executor_backend == "external_launcher"
        and parts.trainer is not None
    ):
        # vLLM's torchrun-style launcher reads RANK and LOCAL_RANK; Lightning's own launcher and SLURM set neither
        os.environ.setdefault("RANK", str(parts.trainer.global_rank))
        os.environ.setdefault("LOCAL_RANK", str(parts.trainer.local_rank))
    path = resolve_path(parts.policy_cfg)
    # a missing package named in 3 lines, not a pydantic error from inside LLM()
    check_vllm_can_load(path)
    return VLLMEngine(
        str(path),
        vllm,
        sampler_logprobs=parts.sampler_logprobs,
        lora_rank=parts.lora_rank,
        load_images=load_images,
        vocabulary_logprobs=cfg.certificate is not None,
    )


def _server_engine(cfg: RolloutConfig, parts: EngineParts) -> RolloutEngine:
    """A ``vllm serve`` engine whose syncs are checked against the policy's own logprobs (the probe)."""
    # Deferred like the in-process engine: the server client is loaded only when a server engine is built.
    from lightning_grpo.rollout.vllm_server import VLLMServerEngine, sequence_logprobs

    server = cfg.server or ServerConfig()
    trainer = parts.trainer
    if trainer is None:
        ranks = Ranks.current(placement=server.placement)
    # the node figures come from the launcher (Lightning reads torchrun's and SLURM's variables)
    else:
        ranks = Ranks.current(
            trainer.node_rank, trainer.local_rank, trainer.num_devices, server.placement
        )
    # The rules across sections (restarts with several ranks, an adapter over HTTP) ran in run_check.
    if server.url is None and server.launch:  # the child runs this Python's vLLM
        check_vllm_can_load(resolve_path(parts.policy_cfg), "vllm_server")

    # what the hand-off pushes once per collected batch, for a restarted server
    def republish() -> None:
        adapter_sync.publish_policy(
            parts.policy, engine, int(cfg.sync_bucket_mb * (1 << 20))
        )

    engine = VLLMServerEngine(
        str(resolve_path(parts.policy_cfg)),
        server,
        reference=functools.partial(sequence_logprobs, parts.policy),
        decode=functools.partial(parts.tokenizer.decode, skip_special_tokens=True),
        sampler_logprobs=parts.sampler_logprobs,
        ranks=ranks,
        republish=republish,
        lora_rank=parts.lora_rank,
    )
    return engine
