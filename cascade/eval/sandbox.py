"""Grading code by running it: an answer's Python code block with hidden asserts, in a child
``python -I`` in a fresh temporary directory, under a timeout and an address-space limit
(``resource.RLIMIT_AS``), its output captured. Only a run that reaches the end of the asserts
passes: a crash, a timeout, a memory bomb, a failed assert or an early ``sys.exit`` is a 0.

This is a grader for our own generated problems answered by our own models, not a security
boundary against a hostile author (that would need a container): the limits keep a wrong or
runaway answer from hanging or starving the calibration host, and the temporary directory is
the child's working directory, so code that deletes files in cwd deletes only its own. What it
does not stop (an attacker reproduced each): writing or deleting files elsewhere by absolute path,
reading the home directory, forked children adding up past the memory limit, a child that leaves
the session (setsid) outliving the grade, and an answer built to pass (an object equal to
everything, or one that finds the nonce in its own program). A grade never waits for such a
child: the timeout holds whatever it keeps open."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)
MAX_OUTPUT = 4096  # characters of the child's output kept


@dataclass(frozen=True)
class RunResult:
    passed: bool
    reason: str  # "passed" | "failed" | "timeout" | "no_code" | "crashed"
    output: str = ""


def extract_code(answer: str) -> str:
    """The first fenced code block (a block cut off by the token limit runs to the end), else the
    answer itself when it reads as code (starts with ``def``, ``import`` or ``from``), else ""."""
    m = _FENCE.search(answer)
    if m:
        return m.group(1).strip("\n")
    text = answer.strip()
    return text if re.match(r"(def|import|from|class)\b", text) else ""


def _limits(memory_bytes: int, cpu_s: int):
    def apply() -> None:  # runs in the child between fork and exec
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_python(code: str, tests: str, timeout_s: float = 5.0, memory_bytes: int = 256 << 20) -> RunResult:
    """Run ``code`` then ``tests`` (asserts) in a child process; passed only if the last line of
    the tests ran (a per-run nonce printed after them) and the child exited 0."""
    if not code.strip():
        return RunResult(False, "no_code")
    nonce = secrets.token_hex(16)
    # the answer is compiled apart from the tests, so a syntax error is a crash, not a test error,
    # and the tests run in the namespace the answer's code built
    program = (f"_src = {code!r}\n_ns = {{'__name__': '__main__'}}\nexec(compile(_src, 'answer.py', 'exec'), _ns)\n"
               f"exec(compile({tests!r}, 'tests.py', 'exec'), _ns)\nprint({nonce!r}, flush=True)\n")
    with tempfile.TemporaryDirectory(prefix="cascade-grade-") as tmp:
        Path(tmp, "grade.py").write_text(program)
        proc = subprocess.Popen(
            [sys.executable, "-I", "grade.py"], cwd=tmp, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, preexec_fn=_limits(memory_bytes, max(1, int(timeout_s) + 1)),
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "PYTHONHASHSEED": "0"},
            start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return RunResult(False, "timeout", _drain(proc).decode(errors="replace")[-MAX_OUTPUT:])
        finally:
            _kill_group(proc)  # whatever the answer forked goes with it
    out = (stdout.decode(errors="replace") + stderr.decode(errors="replace"))[-MAX_OUTPUT:]
    if proc.returncode == 0 and nonce in stdout.decode(errors="replace"):
        return RunResult(True, "passed", out)
    return RunResult(False, "failed" if "AssertionError" in out else "crashed", out)


def _drain(proc: subprocess.Popen) -> bytes:
    """What the killed child wrote, read for a second at most: a descendant that left its session
    (setsid) may hold the pipe open forever, and grading must not wait for it."""
    try:
        stdout, _ = proc.communicate(timeout=1.0)
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
        proc.wait()
        return b""
    return stdout


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)  # the child leads its own session (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def grade(answer: str, tests: str, timeout_s: float = 5.0) -> float:
    """1.0 when the answer's code passes ``tests``, else 0.0."""
    return float(run_python(extract_code(answer), tests, timeout_s).passed)
