"""Runs ``lightning-grpo`` commands as forked children of one process that imported the CLI once.

The kill -9 / resume test (tests/update/test_resume.py) needs three CLI runs; on a loaded 2-core machine
importing torch + Lightning costs 30-90 s of wall time per process. This launcher pays it once:
it imports ``lightning_grpo.cli`` (and runs no torch op, so no thread pool exists yet and forking
is safe), then for each stdin line ``<cwd>\\t<arg>\\t<arg>...`` forks a child that runs
``lightning_grpo.cli.main(args)`` in ``cwd`` (the console script's entry point) with its output in
``cwd/out.log``, and prints ``started <pid>``. When a child ends it prints ``exited <pid> <code>``
(negative: killed by that signal). At EOF on stdin it waits for every child, then exits.

Usage: python tests/cli_forker.py   (then write command lines to its stdin)
"""

from __future__ import annotations

import os
import select
import sys
import traceback

import lightning_grpo.cli


def start(line: str) -> int:
    cwd, *args = line.split("\t")
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.chdir(cwd)
        log = os.open("out.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        lightning_grpo.cli.main(args)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 - a forked run reports any failure in its log and exits non-zero
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def reap(children: set[int], block: bool) -> None:
    while children:
        pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        print("exited", pid, os.waitstatus_to_exitcode(status), flush=True)


def main() -> None:
    children: set[int] = set()
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.2)
        if ready:
            data = os.read(0, 65536)
            if not data:
                break
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = start(line.decode())
                children.add(pid)
                print("started", pid, flush=True)
        reap(children, block=False)
    reap(children, block=True)


if __name__ == "__main__":
    main()
