"""Store-and-forward end to end: a real edge agent (subprocess, SmolLM2 Q4 on llama.cpp) queues
escalations in SQLite while the cloud (`cascade cloud serve --both 1`) cannot be reached, and
delivers each exactly once in effect when it can. Between them a TCP proxy injects the faults
(cloud down, responses lost); the agent itself is killed with SIGKILL."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

from tests import loopback
from tests.conftest import Agent, create_key, gateway_count
from tests.faults import Proxy

MODEL = "smollm2-135m"


def agent_env(proxy: Proxy, key: str, **sync) -> dict:
    env = {"CASCADE_EDGE_UPSTREAM_URL": proxy.url, "CASCADE_EDGE_UPSTREAM_API_KEY": key,
           "CASCADE_EDGE_UPSTREAM_TIMEOUT_S": "60", "CASCADE_EDGE_CASCADE_OFFLINE": "queue",
           "CASCADE_EDGE_CASCADE_DEVICE": "kiosk-9", "CASCADE_EDGE_SYNC_BASE_BACKOFF_S": "0.2",
           "CASCADE_EDGE_SYNC_MAX_BACKOFF_S": "1", "CASCADE_EDGE_SYNC_POLL_S": "0.5"}
    env.update({f"CASCADE_EDGE_SYNC_{k.upper()}": str(v) for k, v in sync.items()})
    return env


def start_agent(home, env) -> Agent:
    return Agent(home, "--n-ctx", "512", "--threads", "1", env=env).wait_healthy()


def post(agent: Agent, text: str, session: str | None = None, **cascade) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0,
            "cascade": {"mode": "cloud", **({"session": session} if session else {}), **cascade}}
    return loopback.post(f"{agent.url}/v1/chat/completions", json=body, timeout=30)


def wait_done(agent: Agent, ids, timeout_s: float = 240) -> dict[str, dict]:
    """Poll GET /v1/requests/{id} until every id is in a final state."""
    deadline, out = time.monotonic() + timeout_s, {}
    pending = list(ids)
    while pending and time.monotonic() < deadline:
        still = []
        for i in pending:
            r = loopback.get(f"{agent.url}/v1/requests/{i}", timeout=10)
            assert r.status_code == 200, r.text
            if r.json()["state"] in ("done", "failed", "expired"):
                out[i] = r.json()
            else:
                still.append(i)
        pending = still
        if pending:
            time.sleep(0.3)
    assert not pending, f"{len(pending)} not delivered in {timeout_s} s, e.g. {pending[0]}"
    return out


def kill(agent: Agent) -> None:
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait()


@pytest.fixture
def proxy(cloud_both):
    p = Proxy(cloud_both.port)
    yield p
    p.down()


def test_queued_while_the_cloud_is_down_then_delivered_once_in_session_order(tmp_path, engine_home, cloud_both, proxy):
    key = create_key(engine_home, "--tenant", "offline-order", "--device", "kiosk-9")
    # the proxy is down: the cloud cannot be reached; the circuit opens for 1 s at a time, so the loop tries often
    agent = start_agent(tmp_path, {**agent_env(proxy, key), "CASCADE_EDGE_UPSTREAM_MAX_BACKOFF_S": "1"})
    calls: list[dict] = []
    hook = _callback_server(calls)
    try:
        accepted: dict[str, list[str]] = {"a": [], "b": []}
        for n in range(6):
            session = "ab"[n % 2]
            extra = {"callback_url": f"http://127.0.0.1:{hook.server_port}/done"} if n == 0 else {}
            r = post(agent, f"Count to {n + 1}.", session=session, **extra)
            assert r.status_code == 202, r.text
            body = r.json()
            assert r.headers["location"] == f"/v1/requests/{body['id']}" == body["location"]
            assert r.headers["x-cascade-tier"] == "queue" and body["state"] == "queued"
            accepted[session].append(body["id"])
        # the app's other policies still hold while the cloud is away
        assert post(agent, "Hi", offline="fail").status_code == 503
        degraded = post(agent, "Hi", offline="local", refine=True)
        assert degraded.status_code == 200 and degraded.headers["x-cascade-degraded"] == "true"
        refinement = degraded.headers["x-cascade-refinement"]
        assert degraded.json()["cascade"]["refinement"] == refinement
        first = loopback.get(f"{agent.url}/v1/requests/{accepted['a'][0]}").json()
        assert first["state"] == "queued" and "response" not in first
        _wait_for_a_failed_try(agent)
        assert gateway_count(cloud_both, "offline-order") == 0  # nothing reached the cloud

        proxy.up()
        ids = accepted["a"] + accepted["b"] + [refinement.rsplit("/", 1)[1]]
        done = wait_done(agent, ids)
        assert {d["state"] for d in done.values()} == {"done"}
        for i in ids:
            resp = done[i]["response"]
            assert resp["object"] == "chat.completion" and resp["choices"][0]["message"]["content"]
        # the cloud executed each once
        assert gateway_count(cloud_both, "offline-order", outcome="ok") == len(ids)
        assert gateway_count(cloud_both, "offline-order", outcome="replay") == 0
        # in per-session order, as the cloud saw them (first arrival of each key)
        first_seen: dict[str, float] = {}
        for t, k in proxy.forwarded:
            first_seen.setdefault(k, t)
        for session_ids in accepted.values():
            assert [first_seen[i] for i in session_ids] == sorted(first_seen[i] for i in session_ids)
        # a done request's answer equals the cloud's own answer to the same request
        direct = openai.OpenAI(base_url=f"{cloud_both.url}/v1", api_key=key, max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to 1."}], max_tokens=4, temperature=0)
        assert done[accepted["a"][0]]["response"]["choices"][0]["message"]["content"] == \
            direct.choices[0].message.content
        # the callback came, with the result
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.1)
        assert calls and calls[0]["id"] == accepted["a"][0] and calls[0]["state"] == "done"
        assert calls[0]["response"] == done[accepted["a"][0]]["response"]
    finally:
        hook.shutdown()
        agent.stop()


def test_a_new_escalation_waits_behind_its_sessions_queued_requests(tmp_path, engine_home, cloud_both, proxy):
    key = create_key(engine_home, "--tenant", "offline-behind", "--device", "kiosk-9")
    agent = start_agent(tmp_path, agent_env(proxy, key))
    try:
        long = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story about a lighthouse."}],
                "max_tokens": 64, "temperature": 0, "cascade": {"mode": "cloud", "session": "door"}}  # seconds
        first = loopback.post(f"{agent.url}/v1/chat/completions", json=long, timeout=30)
        assert first.status_code == 202
        proxy.up()
        _wait(lambda: loopback.get(f"{agent.url}/v1/requests/{first.json()['id']}").json()["state"] == "sending",
              "the queued request to be sent", 30)
        # the cloud is reachable now, but the session's earlier request is still on its way
        behind = post(agent, "And now a short one.", session="door")
        assert behind.status_code == 202 and behind.headers["x-cascade-reason"] == "forced"
        other = post(agent, "Another session.", session="till")  # other sessions go straight up
        assert other.status_code == 200 and other.headers["x-cascade-tier"] == "cloud"
        done = wait_done(agent, [first.json()["id"], behind.json()["id"]], 120)
        assert {d["state"] for d in done.values()} == {"done"}
        order = [k for _, k in proxy.forwarded if k in done]
        assert order.index(first.json()["id"]) < order.index(behind.json()["id"])
    finally:
        agent.stop()


def test_a_lost_response_is_replayed_from_the_cloud_store_and_charged_once(tmp_path, engine_home, cloud_both, proxy):
    key = create_key(engine_home, "--tenant", "offline-dup", "--device", "kiosk-9")
    agent = start_agent(tmp_path, agent_env(proxy, key))
    try:
        r = post(agent, "Name a color.")
        assert r.status_code == 202
        item = r.json()["id"]
        proxy.drop_responses(1)  # the cloud answers the first delivery; the device never hears it
        proxy.up()
        done = wait_done(agent, [item], 60)[item]
        assert done["state"] == "done" and done["attempts"] >= 2 and proxy.dropped == 1
        assert gateway_count(cloud_both, "offline-dup", outcome="ok") == 1
        assert gateway_count(cloud_both, "offline-dup", outcome="replay") >= 1
        usage = done["response"]["usage"]
        charged = gateway_count(cloud_both, "offline-dup", "cascade_gateway_prompt_tokens_total")
        assert charged == usage["prompt_tokens"]  # the replay was not charged
        assert sum(1 for _, k in proxy.forwarded if k == item) >= 2  # it really was sent twice
    finally:
        agent.stop()


def test_a_full_queue_refuses_requests_and_ttls_expire(tmp_path, engine_home, cloud_both, proxy):
    key = create_key(engine_home, "--tenant", "offline-full", "--device", "kiosk-9")
    agent = start_agent(tmp_path, agent_env(proxy, key, max_items=3))
    try:
        short = post(agent, "a", ttl_s=0.5)
        assert short.status_code == 202
        ids = [post(agent, t).json()["id"] for t in ("b", "c")]
        full = post(agent, "d")
        assert full.status_code == 503 and full.json()["error"]["code"] == "offline_queue_full"
        assert "retry-after" in full.headers
        bad = post(agent, "e", callback_url="http://example.com/hook")  # not on this device
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cascade.callback_url"
        _wait(lambda: loopback.get(f"{agent.url}/v1/requests/{short.json()['id']}").json()["state"] == "expired",
              "the 0.5 s TTL to expire the first request", 15)
        assert post(agent, "f").status_code == 202  # the expired one no longer takes room
        assert loopback.get(f"{agent.url}/v1/requests/{ids[0]}").json()["state"] == "queued"
        assert loopback.get(f"{agent.url}/v1/requests/not-an-id").status_code == 404
        # an app that retries a POST whose 202 it lost, with its own Idempotency-Key, gets the same item
        body = {"model": MODEL, "messages": [{"role": "user", "content": "g"}], "cascade": {"mode": "cloud"}}
        url, key_header = f"{agent.url}/v1/chat/completions", {"Idempotency-Key": "app-1"}
        assert loopback.post(url, json=body, headers=key_header).status_code == 503  # full: not stored
        assert _drop(tmp_path, ids[0]) == 0  # the operator makes room while the agent runs
        first = loopback.post(url, json=body, headers=key_header)
        again = loopback.post(url, json=body, headers=key_header)
        assert first.status_code == again.status_code == 202 and first.json()["id"] == again.json()["id"]
        other = loopback.post(url, json={**body, "max_tokens": 3}, headers=key_header)
        assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    finally:
        agent.stop()


def test_kill_9_during_enqueue_and_delivery_loses_nothing_and_runs_each_once(tmp_path, engine_home, cloud_both, proxy):
    """24 SIGKILLs at random points: 12 while apps enqueue (cloud down), 12 while the queue is
    delivered (cloud up). Every acknowledged (202) item is delivered; the cloud ran each once.
    (Each kill costs an agent start, 3-8 s here: 50 kills made this one test 4-5 minutes.)"""
    rng = random.Random(6)
    tenant = "offline-kill"
    key = create_key(engine_home, "--tenant", tenant, "--device", "kiosk-9")
    env = agent_env(proxy, key)
    acked: list[str] = []
    n = 0

    def app(agent: Agent, stop: threading.Event) -> None:
        """Ten requests a second: every acknowledged one is delivered at the end, one cloud
        generation each (unpaced, two apps enqueued 600 in 12 cycles)."""
        nonlocal n
        while not stop.is_set():
            n += 1
            try:
                r = post(agent, f"Repeat the number {n}.", session=f"s{n % 4}")
            except httpx.HTTPError:
                return  # the agent was killed mid-request: not acknowledged
            if r.status_code == 202:
                acked.append(r.json()["id"])
            stop.wait(0.1)

    enqueuing = delivering = 12
    for cycle in range(enqueuing + delivering):
        if cycle == enqueuing:
            proxy.up()
        agent = start_agent(tmp_path, env)
        stop = threading.Event()
        apps = [threading.Thread(target=app, args=(agent, stop)) for _ in range(2)] if cycle < enqueuing else []
        had = len(acked)
        for t in apps:
            t.start()
        if apps:  # killed while the apps' requests come in, not before the first has landed
            _wait(lambda had=had: len(acked) > had, "a request acknowledged", 30)
        time.sleep(rng.uniform(0.05, 1.0 if cycle < enqueuing else 2.0))
        kill(agent)
        stop.set()
        for t in apps:
            t.join()
    assert len(acked) > enqueuing
    agent = start_agent(tmp_path, env)
    try:
        done = wait_done(agent, acked, 600)
        assert {d["state"] for d in done.values()} == {"done"}
        db = sqlite3.connect(tmp_path / "edge" / "queue.db")
        states = dict(db.execute("SELECT state, count(*) FROM outbox WHERE kind = 'request' GROUP BY state"))
        stored = sum(states.values())
        if states.get("done", 0) != stored:  # items written but not acknowledged before a kill: delivered too
            ids = [r[0] for r in db.execute("SELECT id FROM outbox WHERE kind = 'request'")]
            wait_done(agent, ids, 120)
        executed = gateway_count(cloud_both, tenant, outcome="ok")
        assert executed == stored, f"{stored} distinct items, the cloud ran {executed}"
        assert gateway_count(cloud_both, tenant, outcome="499") == 0
        assert gateway_count(cloud_both, tenant, outcome="5xx") == 0
        print(f"\n{len(acked)} acknowledged, {stored} stored, {executed} executed, "
              f"{gateway_count(cloud_both, tenant, outcome='replay'):.0f} replays, "
              f"{len(proxy.forwarded)} sends")
    finally:
        agent.stop()


def _drop(home, item_id: str) -> int:
    """`cascade edge queue drop ID` on the agent's queue while it runs."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    return subprocess.run([sys.executable, "-m", "cascade_cli", "edge", "queue", "drop", item_id], cwd=REPO,
                          env={**os.environ, "CASCADE_HOME": str(home)}, capture_output=True).returncode


def _callback_server(calls: list) -> ThreadingHTTPServer:
    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):
            calls.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_telemetry_is_spooled_while_the_broker_is_down_and_published_after(tmp_path):
    from tests.unit.sync.test_mqtt import DEVICE, FLEET, MOSQUITTO, TOPIC, Mosquitto, Subscriber

    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    sub = Subscriber(broker.port)
    agent = start_agent(tmp_path, {"CASCADE_EDGE_MQTT_HOST": "127.0.0.1", "CASCADE_EDGE_MQTT_PORT": str(broker.port),
                                   "CASCADE_EDGE_MQTT_FLEET": FLEET, "CASCADE_EDGE_CASCADE_DEVICE": DEVICE,
                                   "CASCADE_EDGE_MQTT_TELEMETRY_INTERVAL_S": "0.25"})
    try:
        r = loopback.post(f"{agent.url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200
        _wait(lambda: any(b["requests"] for _, b in sub.received), "a record counting the request")
        topic, rec = sub.received[-1]
        assert topic == TOPIC and rec["device"] == DEVICE and rec["fleet"] == FLEET
        assert rec["model"]["name"] == MODEL and rec["requests"] == {"chat/200": 1.0}
        assert rec["decisions"] == {"edge/edge_only": 1.0} and rec["latency"]["ttft"]["count"] == 1
        assert "queue" in rec and rec["agent"]["python"]

        broker.stop()
        down_at = time.time()
        # 6 = at least the 4 asserted below, made while it is away, plus what was unacked when it went
        _wait(lambda: loopback.get(f"{agent.url}/healthz").json()["queue"]["pending"] >= 6,
              "records spooled while the broker is away", 15)
        broker.start()
        up_at = time.time()
        _wait(lambda: loopback.get(f"{agent.url}/healthz").json()["queue"]["pending"] <= 1, "the spool to drain", 30)
        _wait(lambda: max(b["ts"] for _, b in sub.received) > up_at, "records after the restart", 15)
        stamps = sorted({b["ts"] for _, b in sub.received})
        outage = [t for t in stamps if down_at <= t <= up_at]
        assert len(outage) >= 4  # the records made while the broker was down arrived
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        assert max(gaps) < 1.5, f"a gap of {max(gaps):.2f} s: records were lost"
    finally:
        agent.stop()
        sub.close()
        broker.stop()


def _wait_for_a_failed_try(agent: Agent, timeout_s: float = 15) -> None:
    """Until the agent's circuit to the cloud opens again (its retry-after goes up, not down): the
    delivery loop has tried the cloud since the call, and failed."""
    def retry_after() -> float:
        return loopback.get(f"{agent.url}/healthz", timeout=10).json()["upstream"]["retry_after_s"]

    last = retry_after()

    def reopened() -> bool:
        nonlocal last
        now = retry_after()
        went_up, last = now > last, now
        return went_up

    _wait(reopened, "the delivery loop to try the unreachable cloud", timeout_s)


def _wait(predicate, what: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
