"""The ``cascade`` command as a child process runs it: the demo, the benchmarks and the tests
start subcommands this way, and ``cascade edge install-service`` writes it into a unit file. It
lives beside the command it names, not in ``cascade`` (the lowest layer must not name the top)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

# ``python -m cascade_cli ...`` is the ``cascade`` command, whatever PATH holds
CASCADE = (sys.executable, "-m", "cascade_cli")


def cascade_command(*args: str, log_level: str | None = "WARNING") -> list[str]:
    """The ``cascade`` command line for a child process: this interpreter, this install."""
    return [*CASCADE, *(("--log-level", log_level) if log_level else ()), *args]


def cascade_executable() -> list[str]:
    """The command that runs ``cascade`` here: the console script next to this interpreter, else
    the one on PATH, else this interpreter with ``-m cascade_cli``; absolute either way."""
    script = Path(sys.executable).parent / "cascade"
    if script.is_file() and os.access(script, os.X_OK):
        return [os.path.abspath(script)]
    found = shutil.which("cascade")
    return [os.path.abspath(found)] if found else [os.path.abspath(sys.executable), "-m", "cascade_cli"]
