"""vLLM server engine: ``vllm serve`` in another process (launched here, or at a URL) behind the engine protocol.

Generation: one ``/v1/completions`` request per (prompt, sample), token ids in (``prompt: [ids]``) and out
(``return_token_ids``), each with its own seed (``rollout/sampler.py``, the same seeds as the in-process engine) and,
when the run consumes them, the sampler's logprob of each token (the server runs ``--logprobs-mode
processed_logprobs``: log-softmax after temperature/top-k/top-p, as ``HFEngine``). Requests go out concurrently
(a thread each); the server batches them.

Weight sync: vLLM 0.32's RL API (``/start_weight_update``, ``/update_weights`` per bucket, ``/finish_weight_update``
with the new weight version), with our CPU backend ``lightning_grpo_shm`` (``rollout/shm_transfer.py``): each bucket
is a safetensors blob in ``/dev/shm`` (same node) or in the request body (``weight_transport: http``). Each phase has
``sync_timeout_s`` and a failure names the phase. After the sync the engine is checked: ``/weight_info`` must report
the new version, and the server's logprobs on a fixed probe sequence must match the trainer's within
``probe_tolerance``, so a sync that did not land is an error, never a quiet bias.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor, nn

from lightning_grpo.rollout.base import Prompt, Rollout, SamplingConfig, finish_rollout
from lightning_grpo.rollout.sampler import row_seeds
from lightning_grpo.rollout.server_config import ServerConfig
from lightning_grpo.rollout.server_process import ServerError, ServerProcess, request_json
from lightning_grpo.rollout.sleep import BookkeptSleep, SleepState

PROBE_LENGTH = 24
"""Tokens in the probe sequence (logprobs of the last 23 are compared)."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        config: ``ServerConfig`` (launch a child, or connect to ``url``).
        reference: the trainer's logprobs of a token sequence (``sequence_logprobs`` bound to the policy); None =
            check only the weight version after a sync.
        decode: token ids -> text, for stop strings and forbidden tokens; None = the model folder's tokenizer
            (special tokens skipped, as the other engines decode).
        sampler_logprobs: whether generations ask for sampler logprobs (a launched server then runs
            ``--logprobs-mode processed_logprobs``).

    Example::

        engine = VLLMServerEngine(policy_dir, ServerConfig(dtype="float32"),
                                  reference=functools.partial(sequence_logprobs, policy))
        push_weights(policy, engine)     # start -> update x buckets -> finish -> version and probe checked
        rollouts = engine.generate(prompts, group_size=8, sampling=SamplingConfig(seed=step, logprobs=True))
        engine.close()                   # a launched server is stopped (its whole process group)
    """

    holds_weights = True

    def __init__(self, model_path: str | os.PathLike, config: ServerConfig | None = None,
                 reference: Callable[[Sequence[int]], list[float]] | None = None, decode=None,
                 sampler_logprobs: bool = True) -> None:
        self.config = cfg = config or ServerConfig()
        self.model_path = Path(model_path)
        self.reference, self.decode = reference, decode
        self.server: ServerProcess | None = None
        if cfg.url is None:
            self.server = ServerProcess(str(self.model_path), cfg,
                                        "processed_logprobs" if sampler_logprobs else "raw_logprobs")
            self.server.start()
            self.url = self.server.url
        else:
            self.url = cfg.url.rstrip("/")
            _check_reachable(self.url, cfg)
        self.device = torch.device("cpu")
        """Buckets are materialized on the host (``push_weights`` moves them here)."""
        self.dtype: torch.dtype = self._server_dtype()
        """Weight dtype inside the server; ``push_weights`` casts to it."""
        self.model_name = self._served_model()
        self.probe_ids = _probe_ids(self.model_path)
        reported = self._get("/weight_info", "weight_info")["weight_version"]
        self.version = int(reported) if str(reported).isdigit() else 0
        """Weight version the server holds from this client's syncs (it reports ``str(version)``); a server at a URL
        that other clients already synced continues from its own count."""
        self.last_probe_error: float | None = None
        self._session = False
        self._bucket = 0
        self._sleep = SleepState()
        self._bucket_prefix = Path(_shm_root()) / f"lightning-grpo-sync-{os.getpid()}-{id(self):x}"
        """Bucket files are this plus ``-<n>.safetensors``, each removed right after the server loaded it."""
        self._post("/init_weight_transfer_engine", {"init_info": {}}, "init_weight_transfer_engine")

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
        with ThreadPoolExecutor(max_workers=min(len(bodies), 64) or 1) as pool:
            replies = list(pool.map(self._complete, bodies))
        out = []
        for p, reply in zip(rows, replies):
            choice = reply["choices"][0]
            lps = choice["logprobs"]["token_logprobs"] if sampling.logprobs else None
            out.append(finish_rollout(p, choice["token_ids"], choice["text"], choice["finish_reason"], lps,
                                      sampling, self._decoder() if sampling.stop else self.decode))
        return out

    def _decoder(self):
        """``decode``, or (none given) the model folder's tokenizer, loaded once: the shared stop-string cut needs one."""
        if self.decode is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        return self.decode

    def _body(self, prompt: Prompt, s: SamplingConfig, seed: int) -> dict:
        warped = s.temperature > 0
        return {"model": self.model_name, "prompt": list(prompt.token_ids), "max_tokens": s.max_new_tokens,
                "temperature": s.temperature, "top_p": s.top_p if warped else 1.0, "top_k": s.top_k if warped else 0,
                "seed": seed, "logprobs": 0 if s.logprobs else None, "stop": list(s.stop) or None,
                "return_token_ids": True, "skip_special_tokens": True}

    def _complete(self, body: dict) -> dict:
        try:
            return request_json(self.url, "/v1/completions", body, self.config.request_timeout_s, "generate")
        except ServerError as err:
            raise self._with_log(err) from None

    # -- weight sync (vLLM's RL API) -----------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """One bucket (checkpoint names); the first bucket of a sync opens vLLM's weight-update session."""
        self._sleep.require("weights", call="VLLMServerEngine.load_weights()")
        if not self._session:
            self._post("/start_weight_update", {}, "start_weight_update")
            self._session, self._bucket = True, 0
        self._bucket += 1
        tensors = {name: t.detach().cpu().contiguous() for name, t in named_tensors}
        phase = f"update_weights (bucket {self._bucket})"
        if self.config.weight_transport == "http":
            from safetensors.torch import save

            self._post("/update_weights", {"update_info": {"data": base64.b64encode(save(tensors)).decode()}}, phase)
            return
        from safetensors.torch import save_file

        path = Path(f"{self._bucket_prefix}-{self._bucket}.safetensors")
        save_file(tensors, str(path))  # tmpfs: a memory copy the server maps
        try:
            self._post("/update_weights", {"update_info": {"path": str(path)}}, phase)
        finally:
            path.unlink(missing_ok=True)

    def reset_prefix_cache(self) -> None:
        """End of a sync: finish the session under the next weight version, drop cached KV blocks, check the engine."""
        if self._session:
            self._post("/finish_weight_update", {"weight_version": str(self.version + 1)}, "finish_weight_update")
            self._session = False
            self.version += 1
        self._post("/reset_prefix_cache", {}, "reset_prefix_cache")
        self.check_current()

    def check_current(self) -> float | None:
        """Raise ``StaleEngineError`` unless the server holds the trainer's weights; the probe's max |error|."""
        reported = self._get("/weight_info", "weight_info")["weight_version"]
        if self.version and reported != str(self.version):
            raise StaleEngineError(f"the server at {self.url} reports weight version {reported!r} after this run "
                                   f"published version {self.version}: another client updated it, or it restarted")
        if self.reference is None:
            return None
        server = self.probe_logprobs()
        trainer = self.reference(self.probe_ids)
        error = max(abs(a - b) for a, b in zip(server, trainer))
        self.last_probe_error = error
        tol = self.probe_tolerance
        if not error <= tol:
            raise StaleEngineError(
                f"the server's logprobs on the probe sequence differ from the trainer's by {error:.3g} > "
                f"rollout.server.probe_tolerance={tol:g} (weight version {self.version}): it does not hold the "
                "trainer's weights (a sync that did not land, a server of another model, or a dtype far from the "
                "trainer's: then raise probe_tolerance)")
        return error

    @property
    def probe_tolerance(self) -> float:
        tol = self.config.probe_tolerance
        return tol if tol is not None else (1e-3 if self.dtype == torch.float32 else 0.1)

    def probe_logprobs(self, ids: Sequence[int] | None = None) -> list[float]:
        """The server's ``log p(ids[i] | ids[:i])`` for i >= 1 (prompt logprobs: they bypass the prefix cache)."""
        ids = list(self.probe_ids if ids is None else ids)
        body = {"model": self.model_name, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        reply = self._post("/v1/completions", body, "probe")
        steps = reply["choices"][0]["prompt_logprobs"][1:]
        return [step[str(t)]["logprob"] for step, t in zip(steps, ids[1:])]

    # -- hand-off hooks and lifetime -------------------------------------------------------------------------------
    # sleep, wake_up, asleep: BookkeptSleep (the server is another process; its memory is not the trainer's)
    def close(self) -> None:
        """Stop a launched server (its whole process group); a server at a URL is left running."""
        if self.server is not None:
            self.server.stop()

    # -- HTTP ------------------------------------------------------------------------------------------------------
    def _post(self, path: str, body: dict, phase: str) -> object:
        try:
            return request_json(self.url, path, body, self.config.sync_timeout_s, phase)
        except ServerError as err:
            raise self._with_log(err) from None

    def _get(self, path: str, phase: str) -> dict:
        try:
            return request_json(self.url, path, None, self.config.sync_timeout_s, phase)
        except ServerError as err:
            raise self._with_log(err) from None

    def _with_log(self, err: ServerError) -> ServerError:
        """A launched server that died: the error carries its exit code and last log lines."""
        if self.server is None:
            return err
        if self.server.alive(wait_s=2.0):  # a request cut short may beat the exit by a moment
            return ServerError(f"{err} (vllm serve still running; log: {self.server.log_path})")
        return ServerError(f"{err}\nvllm serve exited with code {self.server.proc.returncode}; its last log lines "
                           f"({self.server.log_path}):\n{self.server.log_tail()}")

    def _served_model(self) -> str:
        models = self._get("/v1/models", "models")["data"]
        return models[0]["id"]

    def _server_dtype(self) -> torch.dtype:
        if self.config.dtype != "auto":
            return _DTYPES[self.config.dtype]
        info = self._get("/server_info", "server_info")  # dev-mode route: the server's resolved config
        text = json.dumps(info)
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
            if f"dtype=torch.{name}" in text or f'"dtype": "torch.{name}"' in text or f'"dtype": "{name}"' in text:
                return dtype
        raise ServerError(f"could not read the model dtype from {self.url}/server_info; set rollout.server.dtype")


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
