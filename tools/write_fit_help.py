"""Write ``lightning_grpo/fit_help.txt``: what ``lightning-grpo fit --help`` prints at 80 columns, for the fast path
of ``lightning_grpo/__main__.py`` (which prints it without importing Lightning).

    python tools/write_fit_help.py

Run it after changing a config field or its docstring, or the pinned Lightning / jsonargparse; tests/test_cli_help.py
fails until the file equals the parser's own output again.
"""

from __future__ import annotations

from lightning_grpo.__main__ import FIT_HELP, recorded_under
from lightning_grpo.cli_help import fresh_fit_help

if __name__ == "__main__":
    FIT_HELP.write_text(recorded_under() + "\n" + fresh_fit_help())
    print(f"wrote {FIT_HELP}")
