"""A launched ``vllm serve`` that fails at start-up, and what a stopped one leaves behind, with a stand-in child
(a Python one-liner in place of vLLM: the same ``ServerProcess`` spawns, waits, reports and stops it)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from lightning_grpo.config import ServerConfig
from lightning_grpo.rollout.server import orphans
from lightning_grpo.rollout.server.http_json import ServerError
from lightning_grpo.rollout.server.process import ServerProcess, last_error_line

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier

SHM = Path("/dev/shm")


def _child(tmp_path: Path, code: str, **cfg) -> ServerProcess:
    """A ServerProcess whose child runs ``code`` instead of vLLM's API server."""
    process = ServerProcess(str(tmp_path), ServerConfig(**cfg), "raw_logprobs")
    process.argv = [sys.executable, "-c", code]
    return process


EXITS = ("import sys\nprint('INFO 12-03 loading the model')\n"
         "print('api_server.py: error: unrecognized arguments: --no-such-flag', file=sys.stderr)\nsys.exit(2)")
SILENT = "import time\nprint('INFO loading weights', flush=True)\ntime.sleep(120)"


def test_a_server_that_exits_at_start_quotes_its_own_error_line(tmp_path):
    """main printed the log's last 30 lines inside the message (vLLM's own one-line error 80 lines up a traceback)."""
    process = _child(tmp_path, EXITS, startup_timeout_s=60)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ServerError) as err:
        process.start()
    # untracked: a dead child's SIGTERM handler left installed turned a later fit's graceful stop into a kill
    assert signal.getsignal(signal.SIGTERM) == before and process not in orphans._LIVE
    lines = str(err.value).splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == ("vllm serve exited with code 2 while starting; it says: api_server.py: error: unrecognized "
                        "arguments: --no-such-flag")
    assert "rollout.server.extra_args" in lines[1] and str(process.log_path) in lines[1]
    assert "INFO 12-03 loading the model" in "".join(err.value.__notes__)  # the tail: error.log keeps it
    assert process.log_path.is_file()
    process.log_path.unlink()  # kept for the user; the test's own goes


def test_a_server_start_up_timeout_shows_its_log_and_keeps_it(tmp_path):
    """main stopped the child (removing its log folder) before reading the tail: the message said '(no log)'."""
    process = _child(tmp_path, SILENT, startup_timeout_s=3)
    with pytest.raises(ServerError) as err:
        process.start()
    message = str(err.value)
    assert "(no log)" not in message and len(message.splitlines()) == 2, message
    assert "within rollout.server.startup_timeout_s=3s; it says: INFO loading weights" in message
    assert "raise rollout.server.startup_timeout_s" in message
    assert process.log_path.read_text().startswith("INFO loading weights")  # kept for the user
    assert not process.alive()
    process.log_path.unlink()


def test_the_last_error_line_of_a_log():
    assert last_error_line("a\nValueError: bad arg\nshutting down\n") == "ValueError: bad arg"
    vllm = ("(VllmWorker-0 pid=9) ERROR 12-03 16:21:50 [multiproc_executor.py:953] ValueError: Available memory on "
            "node 0 (9.47/12.46 GiB) is less than desired\n(EngineCore pid=8) INFO 12-03 16:21:53 [core.py:1] shut\n"
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert last_error_line(vllm) == "ValueError: Available memory on node 0 (9.47/12.46 GiB) is less than desired"
    assert last_error_line("loading\nstill loading\n") == "still loading"
    assert last_error_line("") == "(the log is empty)"


# A child that maps a multiprocessing segment (as vLLM's queues do) and ignores SIGTERM, so it is killed.
HOLDS_SHM = ("import signal, time\nfrom multiprocessing import shared_memory\n"
             "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
             "shm = shared_memory.SharedMemory(create=True, size=1 << 20)\n"
             "print(shm.name, flush=True)\ntime.sleep(120)")


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_a_killed_server_leaves_no_shared_memory(tmp_path):
    """main SIGKILLed the group (its resource tracker too), so vLLM's psm_* segments stayed in RAM until reboot."""
    process = _child(tmp_path, HOLDS_SHM)
    process.spawn()
    deadline = time.monotonic() + 60
    while not process.log_path.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.1)
    segment = SHM / process.log_path.read_text().split()[0].lstrip("/")
    assert segment.exists()
    process.stop(grace_s=0.5)
    assert not process.alive()
    assert not segment.exists()
