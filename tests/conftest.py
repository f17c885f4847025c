"""Shared fixtures: real edge agents in subprocesses on loopback ports, real models."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from cascade.processes import free_port, spawn, stop, wait_healthy
from cascade_cli.spawn import cascade_command
from tests import accounting, loopback

os.environ.setdefault("OMP_WAIT_POLICY", "passive")
# The defaults are the Qwen tier pair (0.5B on the edge, 1.5B in the cloud). A test that starts an
# agent or a cloud tier without naming a model gets SmolLM2-135M, the fast model tests need; a test
# of the pair names it (and tests/unit/test_default_pair.py checks the defaults themselves).
os.environ.setdefault("CASCADE_EDGE_MODEL_NAME", "smollm2-135m")
os.environ.setdefault("CASCADE_CLOUD_ENGINE_MODEL", "smollm2-135m")


class _SnapshotLoggerDict(dict):
    """pytest's log capture (``catching_logs.__enter__``, pytest 9.2) iterates
    ``logging.Logger.manager.loggerDict.values()`` without logging's lock, at the start of every
    phase of every test. A thread that outlives its test and makes a logger meanwhile (the embedded
    broker imports its plugins, and they their loggers, in its own thread) then fails the next test
    with "dictionary changed size during iteration" (a CI run failed so). ``values()`` here is a
    copy taken in one C call, under the GIL: the loop runs over that."""

    def values(self):
        return list(super().values())


def _snapshot_logger_dict() -> None:
    import logging

    with logging._lock:  # noqa: SLF001 (the lock getLogger holds while it adds a logger)
        manager = logging.Logger.manager
        if not isinstance(manager.loggerDict, _SnapshotLoggerDict):
            manager.loggerDict = _SnapshotLoggerDict(manager.loggerDict)


_snapshot_logger_dict()

REPO = Path(__file__).resolve().parent.parent


KINDS = {("edge", "run"): "agent", ("cloud", "serve"): "gateway", ("cloud", "worker"): "worker",
         ("fleet", "serve"): "fleet"}


class Server:
    """A `cascade ...` server process on a free loopback port (its own process group). While it
    runs, the accounting check after every integration test looks at what it holds
    (tests/accounting.py)."""

    def __init__(self, home: Path, command: list[str], *args: str, env: dict | None = None,
                 log_level: str = "WARNING"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = home / f"server-{self.port}.log"
        self.what = "cascade " + " ".join(command)
        self.kind = KINDS[tuple(command[:2])]
        self.proc = spawn(cascade_command(*command, "--port", str(self.port), *args, log_level=log_level),
                          env={"CASCADE_HOME": str(home), **(env or {})}, log=self.log, cwd=REPO)
        accounting.LIVE.append(self)

    def wait_healthy(self, timeout_s: float = 180) -> Server:
        wait_healthy(self.url, self.proc, timeout_s, self.what, log=self.log)
        return self

    def stop(self) -> None:
        stop(self.proc)
        if self in accounting.LIVE:
            accounting.LIVE.remove(self)


def create_key(home: Path, *args: str) -> str:
    """`cascade cloud keys create ...` in ``home``: the new key (its last line of output). The
    command's own ``main`` runs in this process, as `python -m cascade_cli` would run it: a process
    start per key cost ~0.7 s of CPU, and the suite creates a key ~50 times."""
    import contextlib
    import io

    from cascade_cli.main import main

    out, err = io.StringIO(), io.StringIO()
    argv = ["cloud", "keys", "create", *args]
    old = os.environ.get("CASCADE_HOME")
    os.environ["CASCADE_HOME"] = str(home)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:  # a refused command line exits as the command would
                code = e.code if isinstance(e.code, int) else 1
    finally:
        if old is None:
            os.environ.pop("CASCADE_HOME", None)
        else:
            os.environ["CASCADE_HOME"] = old
    if code:
        raise subprocess.CalledProcessError(code, ["cascade", *argv], out.getvalue(), err.getvalue())
    return out.getvalue().strip().splitlines()[-1]


class Agent(Server):
    """A `cascade edge run` process."""

    def __init__(self, home: Path, *args: str, env: dict | None = None, log_level: str = "WARNING"):
        super().__init__(home, ["edge", "run"], *args, env=env, log_level=log_level)


@pytest.fixture(scope="session", autouse=True)
def no_server_outlives_the_session():
    """Whatever server a test started and lost track of (a fixture's teardown that stopped an
    older one) is stopped at the end, never left running after pytest."""
    yield
    for server in list(accounting.LIVE):
        server.stop()


@pytest.fixture(scope="session")
def agent(tmp_path_factory):
    """One agent for the API tests: two slots, one thread each (this machine has 2 cores)."""
    a = Agent(tmp_path_factory.mktemp("edge-home"), "--parallel", "2", "--threads", "1",
              "--n-ctx", "1024", "--max-waiting", "16").wait_healthy()
    yield a
    a.stop()


@pytest.fixture(scope="session")
def client(agent):
    import openai

    return openai.OpenAI(base_url=f"{agent.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def smollm2_path(tmp_path_factory) -> str:
    from model_distribution.artifacts.catalog import Catalog

    return str(Catalog(tmp_path_factory.mktemp("catalog")).get("smollm2-135m").path)


@pytest.fixture(scope="session")
def engine_home(tmp_path_factory):
    """One $CASCADE_HOME for the engine tests, so each GGUF is converted once per session."""
    home = tmp_path_factory.mktemp("cascade-home")
    old = os.environ.get("CASCADE_HOME")
    os.environ["CASCADE_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("CASCADE_HOME", None)
    else:
        os.environ["CASCADE_HOME"] = old


@pytest.fixture(scope="session")
def smollm2_engine(engine_home):
    from cloud_tier.engine import LLMEngine

    return LLMEngine.from_model("smollm2-135m", dtype="float32", max_model_len=1024,
                                max_num_batched_tokens=256, num_kv_blocks=512)


@pytest.fixture(scope="session")
def onnx_export(engine_home, tmp_path_factory):
    """``onnx_export(precision) -> Path``: SmolLM2 exported to ONNX for the CPU ("int4" or "fp32"),
    once per precision per session, unverified (tests/integration/test_onnx_export.py tests the
    verification). Treat the directory as read-only: other tests share it."""
    from cloud_tier.onnx_export import export_onnx

    exports: dict[str, Path] = {}

    def get(precision: str) -> Path:
        if precision not in exports:
            out = tmp_path_factory.mktemp(f"onnx-{precision}") / f"smollm2-135m-onnx-{precision}"
            export_onnx("smollm2-135m", out, precision=precision, target="cpu", verify=False)
            exports[precision] = out
        return exports[precision]

    return get


@pytest.fixture(scope="session")
def cloud_worker(engine_home, smollm2_engine):  # the engine fixture has converted the model already
    """`cascade cloud worker --role both` on SmolLM2-135M, shared by the worker and API tests."""
    w = Server(engine_home, ["cloud", "worker"], "--role", "both", "--model", "smollm2-135m",
               "--max-model-len", "1024", "--kv-cache-bytes", str(256 << 20)).wait_healthy()
    yield w
    w.stop()


@pytest.fixture(scope="session")
def cloud_both(engine_home, smollm2_engine):
    """`cascade cloud serve --both 1` on SmolLM2-135M: the cloud of the cascade and offline tests
    (each test uses a tenant of its own, so counts and quotas do not mix)."""
    g = Server(engine_home, ["cloud", "serve"], "--both", "1", "--prefill", "0", "--decode", "0",
               "--model", "smollm2-135m", "--max-model-len", "1024",
               "--kv-cache-bytes", str(64 << 20)).wait_healthy(300)
    yield g
    g.stop()


def gateway_count(cloud, tenant: str, metric: str = "cascade_gateway_requests_total", **labels) -> float:
    """A gateway counter for ``tenant`` from /metrics, summed over the labels not given."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0  # loopback, not httpx.get: a TLS context per call, and callers poll this
    for family in text_string_to_metric_families(loopback.get(f"{cloud.url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == metric and s.labels.get("tenant") == tenant and all(
                    s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.fixture(scope="session")
def postgres_dsn():
    """A real PostgreSQL server for the session (tests/pg_redis.py): its superuser's DSN. Use
    ``tests.pg_redis.fresh_database(dsn)`` for a database of a test's own."""
    from tests.pg_redis import MissingServer, Postgres

    try:
        server = Postgres()
    except MissingServer as e:
        pytest.fail(str(e), pytrace=False)
    yield server.dsn
    server.stop()


@pytest.fixture(scope="session")
def redis_url():
    """A real Redis server for the session (tests/pg_redis.py): its URL."""
    from tests.pg_redis import MissingServer, Redis

    try:
        server = Redis()
    except MissingServer as e:
        pytest.fail(str(e), pytrace=False)
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def vllm_worker(engine_home, tmp_path_factory):
    """ONE real vLLM (its CPU build, tests/vllm_server.py) on SmolLM2 from our conversion for the
    session: 16 KV blocks of 128 tokens (15 usable: 1,920 tokens), at most 8 requests in a batch,
    max_model_len 1024. Short requests run side by side; two ~800-token prompts hold 14 of the 15
    blocks and queue the rest, so a shedding test can saturate it. It runs vLLM's NixlConnector
    (kv_both), so it can also be the prefill half of a P/D pair, which saves starting one more vLLM
    (~1-2 min here) for the P/D test. Its cost: start to /health 68 and 78 s against 55 and 58 s
    without (load 3-5; importing nixl and making its UCX agent take ~1 s each by its log, the rest
    is the engine process starting slower), and nothing for plain requests (the same greedy
    answers). Fails, not skips, when vLLM's virtualenv is missing (.ci/run installs it)."""
    from model_distribution.artifacts.model_dirs import resolve_model_dir
    from tests.vllm_server import VllmMissing, VllmServer, vllm_python

    try:
        vllm_python()
    except VllmMissing as e:
        pytest.fail(str(e), pytrace=False)
    server = VllmServer(resolve_model_dir("smollm2-135m"), tmp_path_factory.mktemp("vllm"), nixl=True)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    yield server
    server.stop()
