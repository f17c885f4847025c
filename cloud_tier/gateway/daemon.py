"""``cascade cloud serve``: start the workers (prefill, decode, both) as child processes on free
loopback ports, or use ``workers`` started elsewhere, then serve the gateway until stopped."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from cloud_tier.config import CloudConfig

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """A worker did not come up."""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class WorkerProcesses:
    """The workers this gateway started; stopped with it."""

    config: CloudConfig
    config_path: str | None = None
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def start(self) -> list[str]:
        g, e = self.config.gateway, self.config.engine
        roles = ["prefill"] * g.prefill + ["decode"] * g.decode + ["both"] * g.both
        threads = g.worker_threads or e.threads or max(1, (os.cpu_count() or 1) // len(roles))
        host = "127.0.0.1"
        urls = []
        for role in roles:
            port = _free_port(host)
            cmd = [sys.executable, "-m", "cascade.cli", "--log-level", logging.getLevelName(log.getEffectiveLevel()),
                   "cloud", "worker", "--role", role, "--host", host, "--port", str(port), "--model", e.model,
                   "--threads", str(threads), "--dtype", e.dtype, "--device", e.device,
                   "--max-model-len", str(e.max_model_len), "--kv-cache-bytes", str(e.kv_cache_memory_bytes),
                   "--max-num-seqs", str(e.max_num_seqs), "--max-num-batched-tokens", str(e.max_num_batched_tokens)]
            if self.config_path:
                cmd += ["--config", self.config_path]
            if self.config.server.api_key:
                cmd += ["--api-key", self.config.server.api_key]
            url = f"http://{host}:{port}"
            log.info("starting %s worker on %s (%d threads)", role, url, threads)
            self.procs.append((url, subprocess.Popen(cmd, env={**os.environ, "OMP_WAIT_POLICY": "passive"},
                                                     preexec_fn=_die_with_parent)))
            urls.append(url)
        self.wait_healthy()
        return urls

    def wait_healthy(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        pending = dict(self.procs)
        while pending:
            for url, proc in list(pending.items()):
                if proc.poll() is not None:
                    raise StartupError(f"the worker for {url} exited with status {proc.returncode}")
                try:
                    if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                        del pending[url]
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise StartupError(f"workers not healthy after {timeout_s:.0f}s: {', '.join(pending)}")
            time.sleep(0.25)

    def stop(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                p.terminate()
        for _, p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _die_with_parent() -> None:
    """In a started worker: SIGTERM when the gateway's process dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run(config: CloudConfig, config_path: str | None = None) -> None:
    import uvicorn

    from cloud_tier.engine.llm_engine import resolve_model_dir
    from cloud_tier.gateway.app import build_app

    g = config.gateway
    # uvicorn re-raises the SIGTERM it handled once it has shut down; with the default handler
    # that would end this process before the workers it started are stopped
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    resolve_model_dir(config.engine.model)  # convert the model once, before the workers race for it
    children = WorkerProcesses(config, config_path)
    try:
        urls = [u.strip() for u in g.workers.split(",") if u.strip()] or children.start()
        log.info("cloud gateway on http://%s:%d in front of %s", g.host, g.port, ", ".join(urls))
        uvicorn.run(build_app(config, urls), host=g.host, port=g.port, log_level=config.server.log_level,
                    timeout_graceful_shutdown=5, access_log=False)
    finally:
        children.stop()
