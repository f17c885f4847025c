"""The edge agent as a service, on a real `cascade edge run` process (SmolLM2 Q4 on llama.cpp):
the systemd notification protocol received on a datagram socket of the test's own (systemd's end
of $NOTIFY_SOCKET), SIGHUP reloading the config file while a stream runs, SIGTERM draining a
stream and keeping the offline queue, and `cascade edge install-service`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from cascade.processes import free_port
from tests import loopback
from tests.conftest import REPO, Agent

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "Which city is the capital of France?"}]


class NotifySocket:
    """The service manager's end of $NOTIFY_SOCKET: records every datagram with its arrival time.
    ``name`` is an abstract socket name (``@...``) unless a short ``path`` is given."""

    def __init__(self, path: str | None = None):
        self.name = path or f"@cascade-test-{uuid.uuid4().hex[:12]}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path or "\0" + self.name[1:])
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._receive, daemon=True).start()

    def _receive(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096)
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._cond:
                self.messages.append((time.time(), fields))
                self._cond.notify_all()

    def times(self, key: str, since: float = 0.0) -> list[float]:
        with self._cond:
            return [t for t, m in self.messages if key in m and t >= since]

    def wait_for(self, key: str, since: float = 0.0, proc=None, timeout_s: float = 60.0) -> float:
        """When the first message with ``key`` since ``since`` arrived."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not (found := self.times(key, since)):
                assert proc is None or proc.poll() is None, f"the agent exited ({proc.returncode}) before {key}"
                assert time.monotonic() < deadline, f"no {key} in {timeout_s} s: {self.messages}"
                self._cond.wait(0.2)
        return found[0]

    def close(self) -> None:
        self.sock.close()


def write_config(path: Path, upstream_port: int, drain_timeout_s: float = 20, **cascade) -> None:
    lines = ["[model]", f'name = "{MODEL}"', "",
             "[server]", 'log_format = "json"', f"drain_timeout_s = {drain_timeout_s}", "",
             "[upstream]", f'url = "http://127.0.0.1:{upstream_port}"', "timeout_s = 5", "",
             "[cascade]", 'offline = "queue"', *(f"{k} = {v!r}" for k, v in cascade.items())]
    path.write_text("\n".join(lines) + "\n")


def start(home: Path, config: Path, notify: NotifySocket, **env) -> Agent:
    """An agent told to notify ``notify``, started once it says READY=1 (no health polling)."""
    # the file names the model: the suite's CASCADE_EDGE_MODEL_NAME (tests/conftest.py) would override it
    return Agent(home, "--config", str(config), "--threads", "1", "--n-ctx", "512", "--parallel", "2",
                 env={"NOTIFY_SOCKET": notify.name, "CASCADE_EDGE_MODEL_NAME": None, **env})


def ask(agent: Agent, **cascade) -> httpx.Response:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "temperature": 0}
    if cascade:
        body["cascade"] = cascade
    return loopback.post(f"{agent.url}/v1/chat/completions", json=body, timeout=120)


class Stream(threading.Thread):
    """A long local completion, streamed; ``first`` is set at its first chunk."""

    def __init__(self, agent: Agent, max_tokens: int = 120):
        super().__init__(daemon=True)
        self.error: BaseException | None = None
        self.agent, self.max_tokens = agent, max_tokens
        self.first = threading.Event()
        self.lines: list[str] = []
        self.status: int | None = None
        self.start()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True, "cascade": {"mode": "local"}}
        try:
            with loopback.stream("POST", f"{self.agent.url}/v1/completions", json=body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        self.lines.append(line)
                        self.first.set()
        except httpx.HTTPError as e:  # a stream cut short
            self.error = e

    def completed(self) -> bool:
        return (self.status == 200 and len(self.lines) > 2 and self.lines[-1] == "data: [DONE]"
                and not any('"error"' in ln for ln in self.lines))


def sighup(agent: Agent, notify: NotifySocket) -> None:
    """SIGHUP, then wait for the reload's READY=1 (after its RELOADING=1)."""
    sent = time.time()
    agent.proc.send_signal(signal.SIGHUP)
    reloading = notify.wait_for("RELOADING", sent, agent.proc)
    notify.wait_for("READY", reloading, agent.proc)


def log_records(agent: Agent) -> list[dict]:
    return [json.loads(line) for line in agent.log.read_text().splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One agent under a notify socket with a watchdog, on a config file the tests rewrite."""
    home = tmp_path_factory.mktemp("daemon-home")
    config = home / "edge.toml"
    cloud_port = free_port()  # nothing listens there: the cloud cannot be reached
    write_config(config, cloud_port)
    notify = NotifySocket()
    agent = start(home, config, notify, WATCHDOG_USEC="400000")
    ready = notify.wait_for("READY", proc=agent.proc, timeout_s=180)
    health = loopback.get(f"{agent.url}/healthz", timeout=5).status_code  # at once, no polling
    yield {"agent": agent, "notify": notify, "config": config, "cloud_port": cloud_port, "ready": ready,
           "health_at_ready": health}
    agent.stop()
    notify.close()


def test_ready_is_notified_once_the_model_is_loaded_and_the_port_answers(served):
    # /healthz answers only once the lifespan has loaded the model: asked the moment READY=1 came
    assert served["health_at_ready"] == 200
    notify = served["notify"]
    loading = [t for t, m in notify.messages if m.get("STATUS", "").startswith("loading")]
    assert loading and loading[0] <= served["ready"]
    assert "serving" in next(m for t, m in notify.messages if "READY" in m)["STATUS"]


def test_watchdog_pings_come_every_half_watchdog_interval(served):
    since = time.time()
    time.sleep(2.0)
    pings = served["notify"].times("WATCHDOG", since)
    assert 5 <= len(pings) <= 12, pings  # every 0.2 s for WATCHDOG_USEC=400000


def test_sighup_applies_a_new_threshold_while_a_stream_runs_across_it(served):
    agent, notify, config = served["agent"], served["notify"], served["config"]
    write_config(config, served["cloud_port"])
    sighup(agent, notify)
    before = ask(agent)
    assert before.status_code == 200 and before.headers["x-cascade-tier"] == "edge"
    stream = Stream(agent)
    assert stream.first.wait(60)
    write_config(config, served["cloud_port"], max_prompt_tokens=1)  # every prompt is "hard" now
    sighup(agent, notify)
    after = ask(agent)
    assert after.status_code == 202, after.text  # escalated; the cloud is away, so queued
    assert after.headers["x-cascade-tier"] == "queue"
    assert after.headers["x-cascade-reason"] != before.headers["x-cascade-reason"]
    stream.join(120)
    assert stream.completed(), stream.lines[-3:]
    write_config(config, served["cloud_port"])
    sighup(agent, notify)
    assert ask(agent).headers["x-cascade-tier"] == "edge"


def test_sighup_with_a_broken_file_keeps_serving_on_the_old_config(served):
    agent, notify, config = served["agent"], served["notify"], served["config"]
    write_config(config, served["cloud_port"])
    sighup(agent, notify)
    config.write_text(config.read_text() + "max_prompt_tokens = [\n")  # not TOML any more
    sighup(agent, notify)
    r = ask(agent)
    assert r.status_code == 200 and r.headers["x-cascade-tier"] == "edge"
    errors = [rec for rec in log_records(agent) if rec["level"] == "ERROR" and rec["logger"].endswith("reload")]
    assert errors and "keeps its configuration" in errors[-1]["msg"]
    write_config(config, served["cloud_port"])
    sighup(agent, notify)


def test_sighup_swaps_the_cloud_client_and_leaves_the_model_for_a_restart(served):
    agent, notify, config = served["agent"], served["notify"], served["config"]
    other = free_port()
    write_config(config, other)
    config.write_text(config.read_text().replace(f'name = "{MODEL}"', 'name = "gemma3-270m"'))
    sighup(agent, notify)
    health = loopback.get(f"{agent.url}/healthz", timeout=5).json()
    assert health["upstream"]["url"] == f"http://127.0.0.1:{other}/v1"
    warned = [rec for rec in log_records(agent) if rec["level"] == "WARNING" and "restart" in rec["msg"]]
    assert warned and "[model] name" in warned[-1]["msg"]  # a JSON line ([server] log_format = "json")
    assert {"ts", "level", "logger", "msg"} <= set(warned[-1])
    assert loopback.get(f"{agent.url}/v1/models", timeout=5).json()["data"][0]["id"] == MODEL  # not reloaded
    write_config(config, served["cloud_port"])
    sighup(agent, notify)


def test_sigterm_drains_a_running_stream_exits_0_and_keeps_the_queue(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    config = home / "edge.toml"
    write_config(config, free_port())
    short = tempfile.mkdtemp(prefix="nfy", dir="/tmp")  # an AF_UNIX path must stay under 108 bytes
    notify = NotifySocket(os.path.join(short, "notify"))
    agent = start(home, config, notify)
    try:
        notify.wait_for("READY", proc=agent.proc, timeout_s=180)
        queued = ask(agent, mode="cloud", offline="queue")
        assert queued.status_code == 202, queued.text
        item = queued.json()["id"]
        stream = Stream(agent)
        assert stream.first.wait(60)
        sent = time.monotonic()
        agent.proc.send_signal(signal.SIGTERM)
        notify.wait_for("STOPPING", proc=agent.proc, timeout_s=10)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no new connections while it drains
            loopback.get(f"{agent.url}/healthz", timeout=5)
        assert stream.is_alive()  # ... and the stream is still being served
        stream.join(60)
        assert stream.completed(), stream.lines[-3:]
        assert agent.proc.wait(30) == 0
        assert time.monotonic() - sent < 20 + 5  # within [server] drain_timeout_s (and the close)
    finally:
        agent.stop()
        notify.close()
        shutil.rmtree(short, ignore_errors=True)
    listed = subprocess.run([sys.executable, "-m", "cascade_cli", "edge", "queue", "list", "--json"], cwd=REPO,
                            env={**os.environ, "CASCADE_HOME": str(home)}, capture_output=True, text=True, timeout=60)
    assert [(i["id"], i["state"]) for i in json.loads(listed.stdout)] == [(item, "queued")]
    again = Agent(home, "--config", str(config), "--threads", "1", "--n-ctx", "512").wait_healthy()
    try:
        state = loopback.get(f"{again.url}/v1/requests/{item}", timeout=10).json()
        assert state["state"] == "queued" and state["attempts"] >= 1
    finally:
        again.stop()
    assert again.proc.returncode == 0


def test_sigterm_past_the_drain_time_ends_the_stream_with_an_error_and_exits_0(tmp_path):
    """Issue 37 item 12: a 1,500-token stream outlives drain_timeout_s; it ends with an SSE error
    event and [DONE], the generation stops before the model is freed, and the agent exits 0.
    (And item 17: `cascade --log-level DEBUG` logs each request's route.)"""
    home = tmp_path / "home"
    home.mkdir()
    config = home / "edge.toml"
    write_config(config, free_port(), drain_timeout_s=1.0)
    agent = Agent(home, "--config", str(config), "--threads", "1", "--n-ctx", "2048",
                  log_level="DEBUG").wait_healthy()
    try:
        stream = Stream(agent, max_tokens=1500)  # ~40 s of tokens here
        assert stream.first.wait(60)
        sent = time.monotonic()
        agent.proc.send_signal(signal.SIGTERM)
        stream.join(30)
        assert agent.proc.wait(30) == 0
        assert time.monotonic() - sent < 1.0 + 5
    finally:
        agent.stop()
    assert stream.error is None and stream.status == 200
    assert stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
    error = json.loads(stream.lines[-2][len("data:"):])["error"]
    assert error["code"] == "shutting_down" and error["message"] and "type" in error and "param" in error
    assert len(stream.lines) > 3  # tokens came before it
    debug = [r for r in log_records(agent) if r["level"] == "DEBUG" and r["logger"].startswith("edge_agent")]
    assert any("completions request: edge" in r["msg"] for r in debug), debug


def cascade(*args, home):
    return subprocess.run([sys.executable, "-m", "cascade_cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "CASCADE_HOME": str(home)})


@pytest.mark.parametrize("bad, says", [
    (["--user", "root"], "root"),
    (["--user", "Bad Name"], "--user"),
    (["--state-dir", "var/lib/cascade"], "--state-dir"),
    (["--config", "/etc/cascade/my edge.toml"], "--config"),
    (["--exec", "/nonexistent/cascade"], "not an executable"),
    (["--watchdog-sec", "0"], "--watchdog-sec"),
])
def test_install_service_refuses_bad_flags_in_one_line(tmp_path, bad, says):
    r = cascade("edge", "install-service", "--output", str(tmp_path / "unit.service"), *bad, home=tmp_path)
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not (tmp_path / "unit.service").exists()


def test_install_service_writes_the_unit_and_says_what_to_run_next(tmp_path):
    unit = tmp_path / "cascade-edge.service"
    config = tmp_path / "edge.toml"
    config.write_text("[server]\ndrain_timeout_s = 90\n")
    r = cascade("edge", "install-service", "--output", str(unit), "--config", str(config), "--user", "kiosk",
                "--state-dir", "/var/lib/cascade-kiosk", home=tmp_path)
    assert r.returncode == 0, r.stderr
    text = unit.read_text()
    assert "User=kiosk" in text and "StateDirectory=cascade-kiosk" in text
    assert f"edge run --config {config}" in text and "TimeoutStopSec=120" in text  # beyond the file's drain
    exec_start = next(ln for ln in text.splitlines() if ln.startswith("ExecStart="))
    assert os.path.isabs(exec_start.split("=", 1)[1].split()[0])
    assert "useradd" in r.stdout and "systemctl daemon-reload" in r.stdout and "enable --now cascade-edge" in r.stdout
    printed = cascade("edge", "install-service", "--output", "-", "--config", str(config), home=tmp_path)
    assert printed.returncode == 0 and printed.stdout.startswith("[Unit]") and "useradd" in printed.stderr
    if shutil.which("systemd-analyze"):
        v = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
        assert v.returncode == 0, v.stderr
