"""Starting the two tiers for a benchmark: the cloud (`cascade cloud serve`) with a key of its own,
and an edge agent, as child processes of this interpreter's install; the caller waits for them
(``cascade.processes.wait_healthy``) and stops them (``stop``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from cascade.processes import free_port, spawn
from cascade_cli.spawn import cascade_command

REPO = Path(__file__).resolve().parent.parent


def bench_env(work: Path) -> dict:
    """The environment the tiers run in: the models of $CASCADE_HOME (else ~/.cascade), the gateway's
    keys in ``work``, OpenMP threads that do not spin."""
    return {**os.environ, "CASCADE_HOME": os.environ.get("CASCADE_HOME") or str(Path.home() / ".cascade"),
            "OMP_WAIT_POLICY": "passive", "CASCADE_CLOUD_GATEWAY_DB": str(work / "gateway.db")}


def cloud_key(env: dict, work: Path) -> str:
    """A new key of tenant "bench" in the gateway's database in ``work``."""
    out = subprocess.run([*cascade_command(log_level="WARNING"), "cloud", "keys", "create", "--tenant", "bench",
                          "--db", str(work / "gateway.db")], env=env, check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def start_cloud(env: dict, model: str, weight_dtype: str, *flags: str,
                max_model_len: int = 1024) -> tuple[subprocess.Popen, str]:
    """`cascade cloud serve` on a free port (``flags``: its workers, e.g. "--both", "1"): (process, URL)."""
    port = free_port()
    proc = spawn([*cascade_command(log_level="WARNING"), "cloud", "serve", "--port", str(port), "--model", model,
                  *flags, "--weight-dtype", weight_dtype, "--max-model-len", str(max_model_len)], env=env, cwd=REPO)
    return proc, f"http://127.0.0.1:{port}"


def start_edge(env: dict, model: str, *flags: str, n_ctx: int = 1024) -> tuple[subprocess.Popen, str]:
    """`cascade edge run` on a free port (``flags``: more of its flags): (process, URL)."""
    port = free_port()
    proc = spawn([*cascade_command(log_level="WARNING"), "edge", "run", "--port", str(port), "--model", model,
                  "--n-ctx", str(n_ctx), *flags], env=env, cwd=REPO)
    return proc, f"http://127.0.0.1:{port}"
