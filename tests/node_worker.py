"""One trainer rank of a multi-node test (tests/test_nodes.py): ``lightning_grpo.cli.main`` under an audit hook.

torchrun (or the test, as ``srun`` would) starts this once per rank, in the node's own working folder. The hook
records every path the rank opens for writing, creates or renames into (Python's audit events), and at exit
writes the list to ``$LGRPO_AUDIT_DIR/rank<global rank>.txt``: the test then checks who wrote what, where.

Usage: python tests/node_worker.py fit --config job.yaml ...   (the arguments of ``lightning-grpo``)
"""

from __future__ import annotations

import atexit
import os
import sys

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND

_WRITTEN: set[str] = set()


def _writes(event: str, args: tuple) -> str | None:
    """The path a write-like audit event touches, or None."""
    if event == "open":
        path, mode, flags = args
        writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & WRITE_FLAGS)
        return path if writing and isinstance(path, (str, os.PathLike)) else None
    if event in ("os.mkdir", "os.rename", "shutil.copyfile"):
        return args[1] if event != "os.mkdir" else args[0]
    return None


def _hook(event: str, args: tuple) -> None:
    path = _writes(event, args)
    if path is not None:
        _WRITTEN.add(os.path.abspath(os.fspath(path)))


def _report() -> None:
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    folder = os.environ["LGRPO_AUDIT_DIR"]
    written = sorted(_WRITTEN)
    with open(os.path.join(folder, f"rank{rank}.txt"), "a") as f:
        f.write(f"# cwd {os.getcwd()}\n")
        f.write("".join(f"{p}\n" for p in written))


def main() -> None:
    sys.addaudithook(_hook)
    atexit.register(_report)
    import lightning_grpo.cli

    lightning_grpo.cli.main(sys.argv[1:])


if __name__ == "__main__":
    main()
