"""vLLM server engine: ``vllm serve`` in another process (launched here, or at a URL) behind the engine protocol.

Generation: one ``/v1/completions`` request per (prompt, sample), token ids in (``prompt: [ids]``) and out
(``return_token_ids``), each with its own seed (``rollout/sampler.py``, the same seeds as the in-process engine) and,
when the run consumes them, the sampler's logprob of each token (the server runs ``--logprobs-mode
processed_logprobs``: log-softmax after temperature/top-k/top-p, as ``HFEngine``). Requests go out concurrently
(a thread each); the server batches them. Several servers (``rollout.server.url`` as a list, or ``replicas``): prompt
i's whole group goes to server i % N, and since every row carries its own seed the tokens do not depend on the split.

Weight sync: vLLM 0.32's RL API (``/start_weight_update``, ``/update_weights`` per bucket, ``/finish_weight_update``
with the new weight version), with our CPU backend ``lightning_grpo_shm`` (``rollout/server/shm_transfer.py``): each
bucket is a safetensors blob in ``/dev/shm`` (same node) or in the request body (HTTP), picked per server
(``server/placement.py``). Each phase
has ``sync_timeout_s`` and a failure names the phase. After the sync the engine is checked: ``/weight_info`` must report
the new version, and the server's logprobs on a fixed probe sequence must match the trainer's within
``probe_tolerance``, so a sync that did not land is an error, never a quiet bias. With several servers every phase
reaches each (one thread per server, ``server/client.each``) before any samples again, and each is checked
(``server/weight_update.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor, nn

from lightning_grpo.rollout.base import Prompt, Rollout, SamplingConfig, finish_rollout
from lightning_grpo.rollout.sampler import row_seeds
from lightning_grpo.rollout.server.adapters import ServerAdapters
from lightning_grpo.rollout.server.client import ServerClient, each
from lightning_grpo.rollout.server.inflight import (
    Gate,
    check_pausable,
    complete_in_flight,
)
from lightning_grpo.rollout.server.placement import hop_transport
from lightning_grpo.rollout.server.pool import connect
from lightning_grpo.rollout.server.probe import probe_ids
from lightning_grpo.rollout.server.process import ServerDied, ServerError, ServerProcess
from lightning_grpo.rollout.server.ranks import Ranks
from lightning_grpo.rollout.server.restarts import ServerRestarts, repaired
from lightning_grpo.rollout.server.same_model import check_same_model
from lightning_grpo.rollout.server.weight_update import ServerWeightUpdates
from lightning_grpo.rollout.server_config import ServerConfig
from lightning_grpo.rollout.sleep import BookkeptSleep, SleepState

log = logging.getLogger(__name__)


def sequence_logprobs(model: nn.Module, ids: Sequence[int]) -> list[float]:
    """``log p(ids[i] | ids[:i])`` for i >= 1 under ``model`` (float32 log-softmax): the trainer side of the probe."""
    device = next(model.parameters()).device
    with torch.no_grad():
        # [T-1, V]
        logits = model(torch.tensor([list(ids)], device=device)).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(
        1, torch.tensor(ids[1:], device=device)[:, None]
    )[:, 0]
    return lp.cpu().tolist()


class VLLMServerEngine(ServerWeightUpdates, BookkeptSleep):
    """Rollouts from a ``vllm serve`` process; weights through vLLM's weight-transfer API.

    Args:
        model_path: the policy's Hugging Face folder (what a launched server loads; its ``config.json`` gives the
            vocabulary of the probe sequence).
        config: ``ServerConfig`` (launch ``replicas`` children, or connect to each ``url``).
        reference: the trainer's logprobs of a token sequence (``sequence_logprobs`` bound to the policy); None =
            check only the weight version after a sync.
        decode: token ids -> text, for stop strings and forbidden tokens; None = the model folder's tokenizer
            (special tokens skipped, as the other engines decode).
        sampler_logprobs: whether generations ask for sampler logprobs (a launched server then runs
            ``--logprobs-mode processed_logprobs``).
        ranks: the trainer ranks sharing the servers (``server/ranks.py``): rank 0 launches and pushes weights,
            every rank generates its own prompts and checks every sync; None = one rank.
        republish: pushes the trainer's current weights to this engine (a full sync); a launched server restarted
            after it died (``ServerConfig.restarts``, ``server/restarts.py``) gets them before it samples again.
            None = no restarts.
        lora_rank: a LoRA policy published adapter-only (``policy.lora.sync: adapter``): launched servers serve
            adapters, ``load_adapter`` loads each publication and requests name it (``server/adapters.py``).

    Example::

        engine = VLLMServerEngine(policy_dir, ServerConfig(dtype="float32"),
                                  reference=functools.partial(sequence_logprobs, policy))
        push_weights(policy, engine)     # start -> update x buckets -> finish -> version and probe checked
        rollouts = engine.generate(prompts, group_size=8, sampling=SamplingConfig(seed=step, logprobs=True))
        engine.close()                   # launched servers are stopped (each its whole process group)
    """

    holds_weights = True

    def __init__(
        self,
        model_path: str | os.PathLike,
        config: ServerConfig | None = None,
        reference: Callable[[Sequence[int]], list[float]] | None = None,
        decode=None,
        sampler_logprobs: bool = True,
        ranks: Ranks | None = None,
        republish: Callable[[], object] | None = None,
        lora_rank: int | None = None,
    ) -> None:
        self.config = cfg = config or ServerConfig()
        self.adapters = ServerAdapters(lora_rank) if lora_rank else None
        self.republish = republish
        self.restarts = ServerRestarts(cfg.restarts)
        self._held: set[threading.Thread] = set()
        self._interrupted: ServerDied | None = None
        """A death met in the sync under way: its remaining buckets are skipped, and its end recovers."""
        self.model_path = Path(model_path)
        self.reference = reference
        self.decode = decode
        self.ranks = ranks or Ranks()
        adapter_args = self.adapters.launch_args() if self.adapters is not None else []
        self.clients: list[ServerClient] = connect(
            self.model_path, cfg, sampler_logprobs, self.ranks, adapter_args
        )
        """One per server, in ``url`` (or launch) order; prompt i's group goes to ``clients[i % N]``."""
        try:
            self._setup()
        except BaseException:
            # a refused server does not leave the launched ones running until exit
            self.close()
            raise

    def _setup(self) -> None:
        self.device = torch.device("cpu")
        """Buckets are materialized on the host (``push_weights`` moves them here)."""
        dtypes = each(self.clients, ServerClient.dtype)
        if len(set(dtypes)) > 1:
            raise ServerError(
                "rollout.server.url: the servers hold different weight dtypes ("
                + ", ".join(f"{c.url}: {d}" for c, d in zip(self.clients, dtypes))
                + "); start them with the same --dtype, or set rollout.server.dtype"
            )
        self.dtype: torch.dtype = dtypes[0]
        """Weight dtype inside the servers; ``push_weights`` casts to it."""
        each(self.clients, ServerClient.connect)
        each(self.clients, lambda c: check_same_model(c, self.model_path))
        self.probe_ids = probe_ids(self.model_path)
        reported = each(self.clients, ServerClient.weight_version)
        self.version = max(int(r) if r.isdigit() else 0 for r in reported)
        """Weight version the servers hold from this engine's syncs (each reports ``str(version)``); servers at URLs
        that other clients already synced continue from the highest count, so after a sync all report the same."""
        self.last_probe_error: float | None = None
        """The largest probe error over the servers at the last check (each client keeps its own)."""
        self.gate = Gate(self.version) if self.config.inflight_updates else None
        """In-flight updates: when requests may go out and under which version (``server/inflight.py``); None = off."""
        if self.gate is not None:
            each(self.clients, check_pausable)
        self._session = False
        self._bucket = 0
        self._sleep = SleepState()
        self._bucket_prefix = (
            Path(_shm_root()) / f"lightning-grpo-sync-{os.getpid()}-{id(self):x}"
        )
        """Bucket files are this plus ``-<n>.safetensors``, each removed right after the server loaded it."""
        self.transports = {
            c.url: hop_transport(self.config.weight_transport, c.url)
            for c in self.clients
        }
        """Each server's weight transport (``placement.py``): shm on this node, http across nodes."""
        if self.ranks.leads:
            self._post(
                "/init_weight_transfer_engine",
                {"init_info": {}},
                "init_weight_transfer_engine",
            )

    @property
    def url(self) -> str:
        """The first server's URL (the only one's, with one server)."""
        return self.clients[0].url

    @property
    def server(self) -> ServerProcess | None:
        """The first server's launched process (None for a server at a URL)."""
        return self.clients[0].process

    # -- generation ----------------------------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingConfig
    ) -> list[Rollout]:
        """``group_size`` completions per prompt, prompt 0's group first; each its own seeded request."""
        self._sleep.require("weights", "kv_cache", call="VLLMServerEngine.generate()")
        if any(p.images for p in prompts):
            raise ValueError(
                "rollout.engine=vllm_server: prompts with images are not supported yet; use "
                "rollout.engine=vllm (in-process) for a vision-language policy"
            )
        seeds = row_seeds([p.id for p in prompts], group_size, sampling.seed)
        rows = [p for p in prompts for _ in range(group_size)]
        bodies = [self._body(p, sampling, s) for p, s in zip(rows, seeds)]
        # by prompt group: a group shares its prompt's prefix-cache blocks on one server; the seeds fix the tokens
        # (ranks: interleaved, so every rank's first group does not land on the same server)
        r = self.ranks  # per_node: the node's ranks over the node's servers
        targets = [
            self.clients[
                (i // group_size * r.pool_size + r.pool_rank) % len(self.clients)
            ]
            for i in range(len(rows))
        ]
        for client in targets:
            client.requests += 1
        replies = self._complete(targets, bodies)
        return [
            self._rollout(p, reply["choices"][0], sampling)
            for p, reply in zip(rows, replies)
        ]

    def _rollout(
        self, prompt: Prompt, choice: dict, sampling: SamplingConfig
    ) -> Rollout:
        lps = choice["logprobs"]["token_logprobs"] if sampling.logprobs else None
        text = choice["text"]
        # continued across a sync: the text of the whole, not of the parts
        if choice.get("segments", 1) > 1:
            text = self._decoder()(choice["token_ids"])
        rollout = finish_rollout(
            prompt,
            choice["token_ids"],
            text,
            choice["finish_reason"],
            lps,
            sampling,
            self._decoder() if sampling.stop else self.decode,
        )
        if "versions" not in choice:
            return rollout
        # cuts keep a prefix
        return dataclasses.replace(
            rollout, versions=choice["versions"][: len(rollout.token_ids)]
        )

    def _complete(
        self, targets: Sequence[ServerClient], bodies: Sequence[dict]
    ) -> list[dict]:
        """One request per body to its server, up to 64 at a time; the replies in order. A server that died is
        started again and the draw re-sent (the same seeds: the same tokens)."""
        while True:
            try:
                call = (
                    ServerClient.complete
                    if self.gate is None
                    else self._complete_in_flight
                )
                with ThreadPoolExecutor(max_workers=min(len(bodies), 64) or 1) as pool:
                    return list(pool.map(call, targets, bodies))
            except ServerDied as err:
                if threading.current_thread() in self._held:
                    # the async worker: the training thread recovers (``recover``)
                    raise
                self._recover(err)

    def _complete_in_flight(self, client: ServerClient, body: dict) -> dict:
        """One row, continued across the syncs that cut it; each token stamped with its weight version."""
        return complete_in_flight(client, body, self.gate, self._salt_of)

    @property
    def updates_in_flight(self) -> bool:
        """A sync pauses the servers and cuts the requests in flight instead of waiting for them (``UpdatesInFlight``)."""
        return self.gate is not None

    @property
    def server_restarts(self) -> int:
        return self.restarts.done

    def hold_restarts(self, thread: threading.Thread) -> None:
        """A draw on ``thread`` that meets a dead server raises: only the thread owning the trainer's weights may
        republish them (``recover``: the async worker draws)."""
        self._held.add(thread)

    def recover(self, err: BaseException) -> bool:
        """True once the server a draw's ``err`` met dead runs again with the trainer's weights (``RestartsServers``)."""
        if not isinstance(err, ServerDied):
            return False
        if not repaired(err):
            self._recover(err)
        return True

    def _recover(self, err: ServerDied) -> None:
        """Start the dead servers again, then republish the trainer's weights (a whole sync, checked); raises the
        run's stop message when no restart is left or none can happen here."""
        self.restarts.relaunch(
            self.clients, err, self.republish is not None, self.ranks.size
        )
        self._session = False
        self._interrupted = None
        # every server moves to the next version; the probe checks each
        self.restarts.republished(self.republish)

    def _decoder(self):
        """``decode``, or (none given) the model folder's tokenizer, loaded once: the shared stop-string cut needs one."""
        if self.decode is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            self.decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
        return self.decode

    def _body(self, prompt: Prompt, s: SamplingConfig, seed: int) -> dict:
        warped = s.temperature > 0
        model = {} if self._served() is None else {"model": self._served()}
        return {
            **model,
            "prompt": list(prompt.token_ids),
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p if warped else 1.0,
            "top_k": s.top_k if warped else 0,
            "seed": seed,
            "logprobs": 0 if s.logprobs else None,
            "stop": list(s.stop) or None,
            "return_token_ids": True,
            "skip_special_tokens": True,
            **self._salt(),
        }

    def _salt(self) -> dict:
        """``cache_salt``: vLLM hashes it into every prefix-cache block of the request, so blocks cached under another
        weight version never match (``rollout.server.cache_salt``). Versions only grow on a server (a URL's continue
        from its highest), so a salt is never reused for other weights; ranks share it, so they share blocks."""
        return self._salt_of(self.version)

    def _salt_of(self, version: int) -> dict:
        return (
            {"cache_salt": f"lightning-grpo-v{version}"}
            if self.config.cache_salt
            else {}
        )

    @property
    def serves_adapters(self) -> bool:
        """Built with a LoRA rank: a sync publishes the adapter alone (``load_adapter``)."""
        return self.adapters is not None

    def load_adapter(self, tensors: dict[str, Tensor], config_json: str) -> None:
        """Serve this LoRA adapter (peft format) from the next generation on, on every server (a new name each time)."""
        self._sleep.require("weights", call="VLLMServerEngine.load_adapter()")
        if self.adapters is None:
            raise RuntimeError(
                "VLLMServerEngine.load_adapter(): the engine was built without LoRA (lora_rank=None)"
            )
        # every rank is done sampling with the old adapter before it is unloaded
        self.ranks.barrier()
        try:
            self.adapters.publish(self.clients, tensors, config_json, self.ranks.leads)
        except ServerDied as err:
            self._recover(err)  # the republish loads the adapter again

    def _served(self) -> str | None:
        """The loaded LoRA adapter's name requests and probes use; None = the served base model."""
        return None if self.adapters is None else self.adapters.name

    # -- hand-off hooks and lifetime -------------------------------------------------------------------------------
    # sleep, wake_up, asleep: BookkeptSleep (the server is another process; its memory is not the trainer's)
    def close(self) -> None:
        """Stop the launched servers (each its whole process group); servers at URLs are left running."""
        for client in self.clients:
            client.close()
        if self.adapters is not None:
            self.adapters.close()


def _shm_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
