"""The workers ``cascade cloud serve`` starts on this host: child processes on free loopback
ports, which die with the gateway (even when it is killed) and are stopped with it."""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass, field

from cascade.processes import NotHealthy, cascade_command, free_port, spawn, stop, wait_healthy
from cloud_tier.config import CloudConfig

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """A worker did not come up."""


@dataclass
class WorkerProcesses:
    """The workers this gateway started; stopped with it."""

    config: CloudConfig
    config_path: str | None = None
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
            cmd = worker_command(self.config, role, host, port, threads, self.config_path)
            url = f"http://{host}:{port}"
            log.info("starting %s worker on %s (%d threads)", role, url, threads)
            self.procs.append((url, spawn(cmd, env=worker_omp_env(threads), die_with_parent=True)))
        for url, proc in self.procs:
            try:
                wait_healthy(url, proc, timeout_s, "worker")
            except NotHealthy as err:
                raise StartupError(str(err)) from err
        return [url for url, _ in self.procs]

    def stop(self) -> None:
        for _, p in self.procs:
            stop(p, timeout_s=10)


def worker_command(config: CloudConfig, role: str, host: str, port: int, threads: int,
                   config_path: str | None = None) -> list[str]:
    """`cascade cloud worker` for one started worker: the engine settings as flags (a flag or variable
    given to `cloud serve` is in no config file the worker reads), then the config file itself."""
    e = config.engine
    cmd = cascade_command(
        "cloud", "worker", "--role", role, "--host", host, "--port", str(port), "--model", e.model,
        "--threads", str(threads), "--dtype", e.dtype, "--kv-cache-dtype", e.kv_cache_dtype,
        "--device", e.device,
        "--max-model-len", str(e.max_model_len), "--kv-cache-bytes", str(e.kv_cache_memory_bytes),
        "--max-num-seqs", str(e.max_num_seqs), "--max-num-batched-tokens", str(e.max_num_batched_tokens),
        log_level=logging.getLevelName(log.getEffectiveLevel()))
    for flag, value in (("--ttft-slo-s", e.ttft_slo_s), ("--tpot-slo-s", e.tpot_slo_s),
                        ("--reservations", e.reservations)):
        if value:
            cmd += [flag, str(value)]
    cmd += ["--slo-headroom", str(e.slo_headroom), "--tpot-min-batch", str(e.tpot_min_batch),
            "--min-tpot-slo-s", str(e.min_tpot_slo_s)]
    if config_path:
        cmd += ["--config", config_path]
    if config.server.api_key:
        cmd += ["--api-key", config.server.api_key]
    return cmd


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
