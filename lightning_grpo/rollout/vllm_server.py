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
reaches each (one thread per server, ``server/client.each``) before any samples again, and each is checked.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from lightning_grpo.rollout.base import Prompt, Rollout, SamplingConfig, finish_rollout
from lightning_grpo.rollout.sampler import row_seeds
from lightning_grpo.rollout.server.adapters import ServerAdapters
from lightning_grpo.rollout.server.client import ServerClient, each
from lightning_grpo.rollout.server.placement import bucket_bodies, check_reachable_pool, hop_transport
from lightning_grpo.rollout.server.process import ServerError, ServerProcess, free_ports, request_json
from lightning_grpo.rollout.server.ranks import Ranks
from lightning_grpo.rollout.server.same_model import check_same_model
from lightning_grpo.rollout.server_config import ServerConfig
from lightning_grpo.rollout.sleep import BookkeptSleep, SleepState

log = logging.getLogger(__name__)

PROBE_LENGTH = 24
"""Tokens in the probe sequence (logprobs of the last 23 are compared)."""


class StaleEngineError(RuntimeError):
    """The server does not hold the trainer's current weights (a sync did not land, or was skipped)."""


def sequence_logprobs(model: nn.Module, ids: Sequence[int]) -> list[float]:
    """``log p(ids[i] | ids[:i])`` for i >= 1 under ``model`` (float32 log-softmax): the trainer side of the probe."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)], device=device)).logits[0, :-1].float()  # [T-1, V]
    lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:], device=device)[:, None])[:, 0]
    return lp.cpu().tolist()


class VLLMServerEngine(BookkeptSleep):
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
            after it died (``ServerConfig.restarts``) gets them before it samples again. None = no restarts.
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

    def __init__(self, model_path: str | os.PathLike, config: ServerConfig | None = None,
                 reference: Callable[[Sequence[int]], list[float]] | None = None, decode=None,
                 sampler_logprobs: bool = True, ranks: Ranks | None = None,
                 republish: Callable[[], object] | None = None, lora_rank: int | None = None) -> None:
        self.config = cfg = config or ServerConfig()
        self.adapters = ServerAdapters(lora_rank) if lora_rank else None
        self.republish = republish
        self.restarts_left = cfg.restarts
        """Restarts of a dead launched server still allowed (``ServerConfig.restarts``, counted down)."""
        self.model_path = Path(model_path)
        self.reference, self.decode = reference, decode
        self.ranks = ranks or Ranks()
        adapter_args = self.adapters.launch_args() if self.adapters is not None else []
        self.clients: list[ServerClient] = _connect(self.model_path, cfg, sampler_logprobs, self.ranks, adapter_args)
        """One per server, in ``url`` (or launch) order; prompt i's group goes to ``clients[i % N]``."""
        try:
            self._setup()
        except BaseException:
            self.close()  # a refused server does not leave the launched ones running until exit
            raise

    def _setup(self) -> None:
        self.device = torch.device("cpu")
        """Buckets are materialized on the host (``push_weights`` moves them here)."""
        dtypes = each(self.clients, ServerClient.dtype)
        if len(set(dtypes)) > 1:
            raise ServerError("rollout.server.url: the servers hold different weight dtypes ("
                              + ", ".join(f"{c.url}: {d}" for c, d in zip(self.clients, dtypes))
                              + "); start them with the same --dtype, or set rollout.server.dtype")
        self.dtype: torch.dtype = dtypes[0]
        """Weight dtype inside the servers; ``push_weights`` casts to it."""
        each(self.clients, ServerClient.connect)
        each(self.clients, lambda c: check_same_model(c, self.model_path))
        self.probe_ids = _probe_ids(self.model_path)
        reported = each(self.clients, ServerClient.weight_version)
        self.version = max(int(r) if r.isdigit() else 0 for r in reported)
        """Weight version the servers hold from this engine's syncs (each reports ``str(version)``); servers at URLs
        that other clients already synced continue from the highest count, so after a sync all report the same."""
        self.last_probe_error: float | None = None
        """The largest probe error over the servers at the last check (each client keeps its own)."""
        self._session = False
        self._bucket = 0
        self._sleep = SleepState()
        self._bucket_prefix = Path(_shm_root()) / f"lightning-grpo-sync-{os.getpid()}-{id(self):x}"
        """Bucket files are this plus ``-<n>.safetensors``, each removed right after the server loaded it."""
        self.transports = {c.url: hop_transport(self.config.weight_transport, c.url) for c in self.clients}
        """Each server's weight transport (``placement.py``): shm on this node, http across nodes."""
        if self.ranks.leads:
            self._post("/init_weight_transfer_engine", {"init_info": {}}, "init_weight_transfer_engine")

    @property
    def url(self) -> str:
        """The first server's URL (the only one's, with one server)."""
        return self.clients[0].url

    @property
    def server(self) -> ServerProcess | None:
        """The first server's launched process (None for a server at a URL)."""
        return self.clients[0].process

    # -- generation ----------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingConfig) -> list[Rollout]:
        """``group_size`` completions per prompt, prompt 0's group first; each its own seeded request."""
        self._sleep.require("weights", "kv_cache", call="VLLMServerEngine.generate()")
        if any(p.images for p in prompts):
            raise ValueError("rollout.engine=vllm_server: prompts with images are not supported yet; use "
                             "rollout.engine=vllm (in-process) for a vision-language policy")
        seeds = row_seeds([p.id for p in prompts], group_size, sampling.seed)
        rows = [p for p in prompts for _ in range(group_size)]
        bodies = [self._body(p, sampling, s) for p, s in zip(rows, seeds)]
        # by prompt group: a group shares its prompt's prefix-cache blocks on one server; the seeds fix the tokens
        # (ranks: interleaved, so every rank's first group does not land on the same server)
        r = self.ranks  # per_node: the node's ranks over the node's servers
        targets = [self.clients[(i // group_size * r.pool_size + r.pool_rank) % len(self.clients)]
                   for i in range(len(rows))]
        for client in targets:
            client.requests += 1
        try:
            replies = _complete(targets, bodies)
        except ServerError:
            if not self._restart_dead():
                raise
            replies = _complete(targets, bodies)  # the same seeds: the same tokens the dead server would have drawn
        out = []
        for p, reply in zip(rows, replies):
            choice = reply["choices"][0]
            lps = choice["logprobs"]["token_logprobs"] if sampling.logprobs else None
            out.append(finish_rollout(p, choice["token_ids"], choice["text"], choice["finish_reason"], lps,
                                      sampling, self._decoder() if sampling.stop else self.decode))
        return out

    def _restart_dead(self) -> bool:
        """Start the launched servers that died again and republish the trainer's weights to the pool; False (the
        caller raises) when none died, no restart is left, or restarting is not possible here."""
        dead = [c for c in self.clients if c.process is not None and not c.process.alive(wait_s=2.0)]
        if not dead or self.restarts_left <= 0 or self.republish is None or self.ranks.size > 1:
            return False
        for client in dead:
            self.restarts_left -= 1
            log.warning("vllm serve at %s exited with code %s; starting it again (rollout.server.restarts: %d left). "
                        "Its last log lines (%s):\n%s", client.url, client.process.proc.returncode, self.restarts_left,
                        client.process.log_path, client.process.log_tail())
            client.process.restart()
            client.connect()
            client.post("/init_weight_transfer_engine", {"init_info": {}}, "init_weight_transfer_engine")
        self._session = False
        self.republish()  # every server moves to the next version together; the probe checks the restarted ones
        return True

    def _decoder(self):
        """``decode``, or (none given) the model folder's tokenizer, loaded once: the shared stop-string cut needs one."""
        if self.decode is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        return self.decode

    def _body(self, prompt: Prompt, s: SamplingConfig, seed: int) -> dict:
        warped = s.temperature > 0
        model = {} if self._served() is None else {"model": self._served()}
        return {**model, "prompt": list(prompt.token_ids), "max_tokens": s.max_new_tokens,
                "temperature": s.temperature, "top_p": s.top_p if warped else 1.0, "top_k": s.top_k if warped else 0,
                "seed": seed, "logprobs": 0 if s.logprobs else None, "stop": list(s.stop) or None,
                "return_token_ids": True, "skip_special_tokens": True}

    # -- weight sync (vLLM's RL API) -----------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """One bucket (checkpoint names); the first bucket of a sync opens vLLM's weight-update session."""
        self._sleep.require("weights", call="VLLMServerEngine.load_weights()")
        if not self._session:
            self.ranks.barrier()  # every rank is done sampling before the weights change
            if self.ranks.leads:
                self._post("/start_weight_update", {}, "start_weight_update")
            self._session, self._bucket = True, 0
        self._bucket += 1
        tensors = {name: t.detach().cpu().contiguous() for name, t in named_tensors}  # every rank: FSDP2 gathers
        if not self.ranks.leads:
            return  # the same weights: the pool's lead pushes them
        phase = f"update_weights (bucket {self._bucket})"
        path = Path(f"{self._bucket_prefix}-{self._bucket}.safetensors")
        try:  # each server by its hop's transport (placement.py)
            bodies = bucket_bodies(tensors, set(self.transports.values()), path)
            each(self.clients, lambda c: c.post("/update_weights", bodies[self.transports[c.url]], phase))
        finally:
            path.unlink(missing_ok=True)

    @property
    def serves_adapters(self) -> bool:
        """Built with a LoRA rank: a sync publishes the adapter alone (``load_adapter``)."""
        return self.adapters is not None

    def load_adapter(self, tensors: dict[str, Tensor], config_json: str) -> None:
        """Serve this LoRA adapter (peft format) from the next generation on, on every server (a new name each time)."""
        self._sleep.require("weights", call="VLLMServerEngine.load_adapter()")
        if self.adapters is None:
            raise RuntimeError("VLLMServerEngine.load_adapter(): the engine was built without LoRA (lora_rank=None)")
        self.ranks.barrier()  # every rank is done sampling with the old adapter before it is unloaded
        self.adapters.publish(self.clients, tensors, config_json, self.ranks.leads)

    def _served(self) -> str | None:
        """The loaded LoRA adapter's name requests and probes use; None = the served base model."""
        return None if self.adapters is None else self.adapters.name

    def reset_prefix_cache(self) -> None:
        """End of a sync: finish the session under the next weight version, drop cached KV blocks, check the engine."""
        if self._session:
            if self.ranks.leads:
                self._post("/finish_weight_update", {"weight_version": str(self.version + 1)}, "finish_weight_update")
            self._session = False
            self.version += 1
        if self.ranks.leads:
            self._post("/reset_prefix_cache", {}, "reset_prefix_cache")
        self.ranks.barrier()  # no rank samples before the new weights landed
        self.check_current()  # on every rank

    def check_current(self) -> float | None:
        """Raise ``StaleEngineError`` unless every server holds the trainer's weights; the probes' max |error|."""
        for client, reported in zip(self.clients, each(self.clients, ServerClient.weight_version)):
            if self.version and reported != str(self.version):
                raise StaleEngineError(f"the server at {client.url} reports weight version {reported!r} after this "
                                       f"run published version {self.version}: another client updated it, or it "
                                       "restarted")
        if self.reference is None:
            return None
        trainer = self.reference(self.probe_ids)  # once: every server must match the same trainer logprobs
        servers = each(self.clients, lambda c: c.probe(self.probe_ids, self._served()))
        tol = self.probe_tolerance
        for client, server in zip(self.clients, servers):
            client.last_probe_error = max(abs(a - b) for a, b in zip(server, trainer))
        self.last_probe_error = max(c.last_probe_error for c in self.clients)
        for client in self.clients:
            if not client.last_probe_error <= tol:
                where = "" if len(self.clients) == 1 else f", server {client.url}"
                raise StaleEngineError(
                    f"the server's logprobs on the probe sequence differ from the trainer's by "
                    f"{client.last_probe_error:.3g} > rollout.server.probe_tolerance={tol:g} (weight version "
                    f"{self.version}{where}): it does not hold the trainer's weights (a sync that did not land, a "
                    "server of another model, or a dtype far from the trainer's: then raise probe_tolerance)")
        return self.last_probe_error

    @property
    def probe_tolerance(self) -> float:
        tol = self.config.probe_tolerance
        return tol if tol is not None else (1e-3 if self.dtype == torch.float32 else 0.1)

    def probe_logprobs(self, ids: Sequence[int] | None = None, server: int = 0) -> list[float]:
        """Server ``server``'s ``log p(ids[i] | ids[:i])`` for i >= 1 (prompt logprobs bypass the prefix cache)."""
        return self.clients[server].probe(self.probe_ids if ids is None else ids, self._served())

    # -- hand-off hooks and lifetime -------------------------------------------------------------------------------
    # sleep, wake_up, asleep: BookkeptSleep (the server is another process; its memory is not the trainer's)
    def close(self) -> None:
        """Stop the launched servers (each its whole process group); servers at URLs are left running."""
        for client in self.clients:
            client.close()
        if self.adapters is not None:
            self.adapters.close()

    def _post(self, path: str, body: dict, phase: str) -> None:
        """One phase on every server, concurrently; returns once each has answered (a failure names its URL)."""
        each(self.clients, lambda c: c.post(path, body, phase))


def _complete(targets: Sequence[ServerClient], bodies: Sequence[dict]) -> list[dict]:
    """One ``/v1/completions`` request per body to its server, up to 64 at a time; the replies in order."""
    with ThreadPoolExecutor(max_workers=min(len(bodies), 64) or 1) as pool:
        return list(pool.map(ServerClient.complete, targets, bodies))


def _connect(model_path: Path, cfg: ServerConfig, sampler_logprobs: bool, ranks: Ranks,
             adapter_args: Sequence[str] = ()) -> list[ServerClient]:
    """A client per server at ``cfg.url``, or per launched replica (all spawned first, so they load side by side;
    several trainer ranks: rank 0 launches them and tells the others where they answer)."""
    if cfg.url is None and ranks.size > 1:
        check_reachable_pool(cfg.host, ranks)
        clients, failure = [], None
        if ranks.leads:
            try:
                clients = _connect(model_path, cfg, sampler_logprobs, Ranks(), adapter_args)
            except Exception as err:  # noqa: BLE001 - the other ranks must hear of it, not wait forever
                failure = err
        urls = ranks.from_lead(f"error: {failure}" if failure is not None else [c.url for c in clients])
        if failure is not None:
            raise failure
        if isinstance(urls, str):
            raise ServerError(f"the pool's lead rank could not launch vllm serve ({urls[7:]})")
        return clients or [ServerClient(url, cfg) for url in urls]
    if cfg.url is not None:
        for url in cfg.urls:
            _check_reachable(url, cfg)
        return [ServerClient(url, cfg) for url in cfg.urls]
    mode = "processed_logprobs" if sampler_logprobs else "raw_logprobs"
    replicas = [cfg.replica(i) for i in range(cfg.replicas)]
    if cfg.port is None and cfg.replicas > 1:  # picked together: two replicas never race for one port
        replicas = [replace(r, port=port) for r, port in zip(replicas, free_ports(cfg.host, cfg.replicas))]
    processes = [ServerProcess(str(model_path), r, mode, adapter_args) for r in replicas]
    try:
        for process in processes:
            process.spawn()
        for process in processes:
            process.wait_ready()
    except BaseException:
        for process in processes:
            process.stop()
        raise
    return [ServerClient(p.url, cfg, p) for p in processes]


def _check_reachable(url: str, cfg: ServerConfig) -> None:
    """Refuse, quickly and naming the knob, a URL that does not answer or lacks the RL routes."""
    timeout = max(1.0, cfg.startup_timeout_s / 10)
    try:
        request_json(url, "/health", timeout=timeout, phase="health")
    except ServerError as err:
        raise ServerError(f"rollout.server.url={url}: no vLLM server answers there ({err}); start one (docs/async.md) "
                          "or set rollout.server.url: null to launch one as a child of this run") from None
    try:
        request_json(url, "/weight_info", timeout=timeout, phase="weight_info")
    except ServerError as err:
        raise ServerError(f"rollout.server.url={url}: the server has no weight-update routes ({err}); start it with "
                          "VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{\"backend\": \"lightning_grpo_shm\"}' "
                          "(docs/async.md)") from None


def _probe_ids(model_path: Path) -> list[int]:
    """A fixed sequence spread over the vocabulary (the same every run)."""
    vocab = json.loads((model_path / "config.json").read_text())
    vocab = vocab.get("vocab_size") or vocab.get("text_config", {}).get("vocab_size")
    return [(7 * i + 3) % vocab for i in range(PROBE_LENGTH)]


def _shm_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
