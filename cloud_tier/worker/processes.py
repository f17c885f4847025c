"""The workers ``cascade cloud serve`` starts on this host: child processes on free loopback
ports, which die with the gateway (even when it is killed) and are stopped with it."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from cascade.processes import free_port, spawn, stop
from cloud_tier.config import CloudConfig
from cloud_tier.worker.settings import SETTINGS_ENV, worker_settings

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """A worker did not come up."""


@dataclass
class WorkerProcesses:
    """The workers this gateway started; stopped with it."""

    config: CloudConfig
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def start(self, timeout_s: float = 600.0) -> list[str]:
        """Start the configured prefill, decode and co-located workers; their URLs once healthy."""
        from model_distribution.artifacts.model_dirs import resolve_model_dir

        g, e = self.config.gateway, self.config.engine
        resolve_model_dir(e.model)  # convert the model once, before the workers race for it
        roles = ["prefill"] * g.prefill + ["decode"] * g.decode + ["both"] * g.both
        threads = g.worker_threads or e.threads or max(1, (os.cpu_count() or 1) // len(roles))
        host = "127.0.0.1"
        for role in roles:
            port = free_port(host)
            cmd, settings = worker_command(self.config, role, host, port, threads)
            url = f"http://{host}:{port}"
            log.info("starting %s worker on %s (%d threads)", role, url, threads)
            self.procs.append((url, spawn(cmd, env={**worker_omp_env(threads), **settings}, die_with_parent=True)))
        _wait_all_healthy([(role, url, proc) for role, (url, proc) in zip(roles, self.procs, strict=True)], timeout_s)
        return [url for url, _ in self.procs]

    def stop(self) -> None:
        for _, p in self.procs:
            stop(p, timeout_s=10)


def _wait_all_healthy(workers: list[tuple[str, str, subprocess.Popen]], timeout_s: float) -> None:
    """Every worker healthy within ``timeout_s``; StartupError at once when any exits first (one killed
    for memory while another still loads), naming it and how it ended. One client for the whole wait
    (a client per poll builds a TLS context each time, on the cores the workers load their models on)."""
    deadline = time.monotonic() + timeout_s
    pending = list(workers)
    with httpx.Client(timeout=1.0) as client:
        while pending:
            for role, url, proc in list(pending):
                if proc.poll() is not None:
                    raise StartupError(f"the {role} worker at {url} {_how_it_ended(proc.returncode)} while starting")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{url}/healthz").status_code == 200:
                        pending.remove((role, url, proc))
            if pending and time.monotonic() > deadline:
                role, url, _ = pending[0]
                raise StartupError(f"the {role} worker at {url} was not healthy after {timeout_s:.0f} s")
            if pending:
                time.sleep(0.2)


def _how_it_ended(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with status {returncode}"
    return f"killed by signal {-returncode}" + (" (out of memory?)" if returncode == -9 else "")


def worker_command(config: CloudConfig, role: str, host: str, port: int, threads: int
                   ) -> tuple[list[str], dict[str, str]]:
    """``python -m cloud_tier.worker`` for one started worker, and the environment that carries its settings:
    this gateway's whole configuration (a flag or variable given to `cloud serve` is in no config file the
    worker could read), with the worker's role, address and threads, and this process's log level. The
    settings hold keys and database URLs, so they travel in the environment (readable by this user alone),
    never in the command line (``ps`` shows it to every user of the host)."""
    worker = dataclasses.replace(
        config, server=dataclasses.replace(config.server, host=host, port=port),
        engine=dataclasses.replace(config.engine, threads=threads),
        worker=dataclasses.replace(config.worker, role=role))
    level = logging.getLevelName(log.getEffectiveLevel())
    return [sys.executable, "-m", "cloud_tier.worker"], {SETTINGS_ENV: worker_settings(worker, level)}


def worker_omp_env(threads: int) -> dict[str, str | None]:
    """The OpenMP wait policy of a worker with more than one thread: a bounded spin
    (GOMP_SPINCOUNT, $CASCADE_ENGINE_OMP_SPINCOUNT, default 30000; 0 keeps OMP_WAIT_POLICY=passive).
    A decode step runs ~360 short parallel regions; with passive threads each wakes its helpers
    (tens of microseconds), which at batch 1-16 was 40% of the step (SmolLM2 bf16, 2 cores: 36.7 ->
    21.2 ms a step at batch 1). The spin ends by itself (about a millisecond) once the step is done."""
    spin = os.environ.get("CASCADE_ENGINE_OMP_SPINCOUNT", "30000")
    if threads <= 1 or spin in ("", "0"):
        return {}
    return {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": spin}
