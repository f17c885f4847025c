"""A real vLLM OpenAI server (its CPU build, in the virtualenv scripts/install-vllm.sh makes) on a
loopback port, for the tests and benchmarks that put vLLM behind the gateway.

How it is started, and why (measured here, /work/notes/vllm-findings.md):
- ``--enforce-eager``: no torch.compile warm-up;
- ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the model runs in the engine-core process instead of one
  more worker process, a whole Python + torch + vLLM import (~25 s on the loaded 2-core machine);
- ``--num-gpu-blocks-override N`` (honoured on CPU): a KV budget of N blocks of 128 tokens, small
  enough for a test to fill, with ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) as the ceiling;
- offline: the model is our SmolLM2 conversion, no hub look-ups;
- ``nixl=True``: vLLM's NixlConnector as ``kv_both`` (one server can be the prefill or the decode
  half of a P/D pair) with its KV buffer in CPU memory, UCX over tcp/shared memory, and a NIXL
  side-channel port of its own (two servers on one host must not share the default 5600).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from cascade.processes import free_port, spawn, stop, wait_healthy

VLLM_VENV = Path(os.environ.get("CASCADE_VLLM_VENV") or Path.home() / ".cache/cascade/vllm-venv")
MODEL = "smollm2-135m"
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


class VllmMissing(RuntimeError):
    """vLLM's virtualenv is not installed (or not finished installing)."""


def vllm_python(venv: Path = VLLM_VENV) -> Path:
    """The venv's python; ``VllmMissing`` saying how to install it when it is not there.
    install-vllm.sh writes ``.installed`` last, so a half-made venv counts as missing, and one made
    before it installed nixl (its ``.installed`` does not name nixl) counts as unfinished."""
    python, marker = venv / "bin" / "python", venv / ".installed"
    if not python.exists() or not marker.is_file():
        raise VllmMissing(f"vLLM's CPU build is not installed in {venv}: run `bash scripts/install-vllm.sh` "
                          "(.ci/run does, before the tests)")
    if "nixl" not in marker.read_text():
        raise VllmMissing(f"vLLM's virtualenv in {venv} has no nixl: run `bash scripts/install-vllm.sh` "
                          "(it adds it)")
    return python


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` serving ``model_dir`` as ``MODEL`` in a
    process group of its own, its output in ``log_dir``. ``extra_args`` and ``env`` are passed on.
    ``nixl``: with the NixlConnector (``NIXL``), its side channel on ``nixl_port``."""

    def __init__(self, model_dir: Path, log_dir: Path, *extra_args: str, num_blocks: int | None = 16,
                 max_num_seqs: int = 8, max_model_len: int = 1024, nixl: bool = False,
                 env: dict[str, str] | None = None):
        self.model = MODEL
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log_dir) / f"vllm-{self.port}.log"
        cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
               "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
               "--max-num-seqs", str(max_num_seqs), *extra_args]
        if num_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(num_blocks)]
        base = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1"}
        self.nixl_port = None
        if nixl:
            self.nixl_port = free_port()
            cmd += ["--kv-transfer-config", json.dumps(NIXL)]
            base.update(VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.nixl_port), UCX_TLS="tcp,self,sm")
        self.proc: subprocess.Popen = spawn(cmd, env={**base, **(env or {})}, log=self.log, cwd=log_dir)

    def wait_healthy(self, timeout_s: float = 600) -> VllmServer:
        """Until /health answers 200; ``NotHealthy`` with the log's tail if it exits or times out."""
        wait_healthy(self.url, self.proc, timeout_s, f"vLLM ({self.log})", path="/health", log=self.log)
        return self

    def load(self) -> dict[str, float]:
        """The load gauges of its /metrics (``GAUGES``), summed over engines."""
        from prometheus_client.parser import text_string_to_metric_families

        out = dict.fromkeys(GAUGES, 0.0)
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in out:
                    out[s.name] += s.value
        return out

    def wait_idle(self, timeout_s: float = 60) -> dict[str, float]:
        """Until nothing runs or waits on it (a test's aborted requests take a step to go); the
        last load read. ``TimeoutError`` if it is still busy after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            load = self.load()
            if not load["vllm:num_requests_running"] and not load["vllm:num_requests_waiting"]:
                return load
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM at {self.url} still busy after {timeout_s:.0f} s: {load}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the server and its engine core at once, as a crash would."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM (vLLM shuts down in ~3 s), SIGKILL after 30 s; idempotent."""
        stop(self.proc, timeout_s=30)
