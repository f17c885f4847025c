"""Child processes on loopback: a free port, waiting until a server is healthy, and stopping a
process with everything it started. One place for what the gateway (its workers), the demo,
the benchmarks and the tests all do. (The ``cascade`` command line itself: cascade_cli.spawn.)"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx


class NotHealthy(RuntimeError):
    """A server exited, or did not answer its health check in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (the OS's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn(cmd: list[str], env: dict[str, str | None] | None = None, log: Path | None = None,
          cwd: str | os.PathLike | None = None, die_with_parent: bool = False) -> subprocess.Popen:
    """Start ``cmd`` in a process group of its own (so ``stop`` ends its children too), with
    OpenMP threads that do not spin-wait (unless ``env`` says otherwise; a None value removes a
    variable), its output to ``log`` (else inherited)."""
    full_env = {k: v for k, v in {**os.environ, "OMP_WAIT_POLICY": "passive", **(env or {})}.items() if v is not None}
    out = open(log, "ab") if log is not None else None  # noqa: SIM115 (the child keeps it)
    try:
        return subprocess.Popen(cmd, env=full_env, cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT if out else None, start_new_session=True,
                                preexec_fn=_die_with_parent if die_with_parent else None)
    finally:
        if out is not None:
            out.close()


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 600.0,
                 what: str = "server", path: str = "/healthz", log: Path | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
    """Poll ``url + path`` until it answers 200; ``NotHealthy`` when ``proc`` exits first or
    ``timeout_s`` passes (with the tail of ``log``, when given)."""
    deadline = time.monotonic() + timeout_s
    # one client for the whole wait: httpx.get builds a client, and so a TLS context, per call (~60 ms
    # of CPU loading the CA bundle, every 0.2 s, beside the server it waits for)
    with httpx.Client(timeout=1.0) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise NotHealthy(f"the {what} at {url} exited with status {proc.returncode}{_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}{path}").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise NotHealthy(f"the {what} at {url} was not healthy after {timeout_s:.0f} s{_tail(log)}")
            sleep(0.2)


def stop(proc: subprocess.Popen, timeout_s: float = 15.0) -> int:
    """SIGTERM the process (and its group, when it leads one, as ``spawn`` makes it), SIGKILL
    after ``timeout_s``, then SIGKILL what it left in its group; the exit status. Idempotent."""
    leads_group = False
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            leads_group = os.getpgid(proc.pid) == proc.pid
        _signal(proc, signal.SIGTERM, leads_group)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGKILL, leads_group)
            proc.wait()
    if leads_group:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


def _signal(proc: subprocess.Popen, sig: int, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


def _die_with_parent() -> None:
    """In the child: SIGTERM when the parent dies, even by SIGKILL (Linux's PR_SET_PDEATHSIG)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def _tail(log: Path | None, lines: int = 40) -> str:
    if log is None or not Path(log).is_file():
        return ""
    text = Path(log).read_text(errors="replace").splitlines()[-lines:]
    return "\n" + "\n".join(text)
