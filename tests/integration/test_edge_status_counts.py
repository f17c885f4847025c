"""Every answer of the edge agent's OpenAI API is counted once with its status (issue 36, item
15): in ``cascade_edge_requests_total``, in the telemetry record the fleet reads, and so in the
fleet's error rate. One real agent (SmolLM2, an API key, a cloud on a closed port and offline
"fail", telemetry spooled for a broker that is not there) answers a mix of good and bad requests."""

from __future__ import annotations

import json
import sqlite3
import time
from types import SimpleNamespace

import pytest
from fastapi import APIRouter, Request
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from cascade.generation import Finish, TokenEvent
from cascade.openai_format import CompletionFormatter
from cascade.processes import free_port
from cascade.web import build_openai_app, openai_response
from edge_agent.server.metrics import EdgeMetrics
from edge_agent.server.status_count import CountAnswers, settle
from model_distribution.fleet.serving import serving_summary
from tests import loopback
from tests.conftest import Agent

MODEL = "smollm2-135m"
KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    home = tmp_path_factory.mktemp("status-counts")
    a = Agent(home, "--api-key", KEY, "--threads", "1", "--n-ctx", "512", env={
        "CASCADE_EDGE_UPSTREAM_URL": f"http://127.0.0.1:{free_port()}", "CASCADE_EDGE_UPSTREAM_API_KEY": "none",
        "CASCADE_EDGE_CASCADE_OFFLINE": "fail", "CASCADE_EDGE_CASCADE_DEVICE": "kiosk-9",
        "CASCADE_EDGE_MQTT_HOST": "127.0.0.1", "CASCADE_EDGE_MQTT_PORT": str(free_port()),
        "CASCADE_EDGE_MQTT_TELEMETRY_INTERVAL_S": "0.25"}).wait_healthy()
    a.home = home
    yield a
    a.stop()


def post(edge, path, json=None, content=None, headers=AUTH):
    return loopback.post(f"{edge.url}{path}", json=json, content=content, headers=headers, timeout=60)


def request_counts(edge) -> dict[tuple[str, str], float]:
    counts = {}
    for family in text_string_to_metric_families(loopback.get(f"{edge.url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "cascade_edge_requests_total":
                counts[s.labels["endpoint"], s.labels["status"]] = s.value
    return counts


def latest_telemetry(home) -> dict | None:
    """The newest telemetry record the agent spooled (its broker is down, so all stay queued)."""
    with sqlite3.connect(f"file:{home / 'edge' / 'queue.db'}?mode=ro", uri=True) as db:
        row = db.execute("SELECT payload FROM outbox WHERE kind = 'telemetry' ORDER BY seq DESC LIMIT 1").fetchone()
    return json.loads(row[0]) if row else None


def test_every_answer_is_counted_once_with_its_status_in_metrics_and_telemetry(edge):
    assert post(edge, "/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 2}).status_code == 200
    with loopback.stream("POST", f"{edge.url}/v1/completions", headers=AUTH, timeout=60,
                         json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True}) as r:
        assert r.status_code == 200 and r.read().rstrip().endswith(b"data: [DONE]")
    assert post(edge, "/v1/chat/completions", content=b'{"model": "x", "messages": [',
                headers={**AUTH, "content-type": "application/json"}).status_code == 400
    assert post(edge, "/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    assert post(edge, "/v1/chat/completions", json=big).status_code == 413
    assert post(edge, "/v1/chat/completions", json={"model": MODEL, "messages": HI}, headers={}).status_code == 401
    assert loopback.get(f"{edge.url}/v1/models", timeout=10).status_code == 401
    # the cloud must answer and cannot be reached: 503, streamed or not (the stream never starts)
    cloud = {"model": MODEL, "messages": HI, "max_tokens": 2, "cascade": {"mode": "cloud"}}
    assert post(edge, "/v1/chat/completions", json=cloud).status_code == 503
    assert post(edge, "/v1/chat/completions", json={**cloud, "stream": True}).status_code == 503
    queued = post(edge, "/v1/chat/completions", json={**cloud, "cascade": {"mode": "cloud", "offline": "queue"}})
    assert queued.status_code == 202
    assert loopback.get(f"{edge.url}{queued.headers['location']}", headers=AUTH, timeout=10).status_code == 200
    assert loopback.get(f"{edge.url}/v1/models", headers=AUTH, timeout=10).status_code == 200
    assert loopback.get(f"{edge.url}/v1/nothing", headers=AUTH, timeout=10).status_code == 404
    assert loopback.get(f"{edge.url}/healthz", timeout=10).status_code == 200  # not counted, nor /metrics

    expected = {("chat", "200"): 1, ("completions", "200"): 1, ("chat", "400"): 1, ("completions", "404"): 1,
                ("chat", "413"): 1, ("chat", "401"): 1, ("models", "401"): 1, ("chat", "503"): 2,
                ("chat", "202"): 1, ("requests", "200"): 1, ("models", "200"): 1, ("other", "404"): 1}
    assert request_counts(edge) == expected

    deadline = time.monotonic() + 20
    while (record := latest_telemetry(edge.home)) is None or sum(record["requests"].values()) < 13:
        assert time.monotonic() < deadline, f"no telemetry record counting every answer: {record}"
        time.sleep(0.25)
    assert record["requests"] == {f"{e}/{s}": n for (e, s), n in expected.items()}
    from model_distribution.protocol import device_messages
    assert device_messages.validate("telemetry", {**record, "id": "t1"})  # the control plane takes what it sends
    summary = serving_summary(record)
    # the fleet counts the answers to prompts (chat, completions): listings and polls are not served requests
    assert summary["requests"] == 9 and summary["error_rate"] == round(2 / 9, 4)


# what a live agent cannot be made to do on purpose: fail unexpectedly, before or during a stream


def _app_failing_on_purpose() -> tuple[TestClient, EdgeMetrics]:
    router = APIRouter(prefix="/v1")

    @router.post("/chat/completions")
    async def boom(request: Request):
        raise RuntimeError("a bug")

    @router.post("/completions")
    async def breaks_mid_stream(request: Request):
        async def events():
            yield TokenEvent(1, "Hel", b"Hel", -0.1, 0.1)
            raise RuntimeError("the backend died")
            yield Finish("stop", 1, 1)  # never reached

        return await openai_response(request, events(), CompletionFormatter(MODEL, None), True, False,
                                     lambda status: settle(request, status))

    app = build_openai_app("t", None, SimpleNamespace(), "edge", router)
    app.add_middleware(CountAnswers)
    metrics = EdgeMetrics()
    app.state.service = SimpleNamespace(metrics=metrics)
    return TestClient(app, raise_server_exceptions=False), metrics


def _counts(metrics: EdgeMetrics) -> dict[tuple[str, str], float]:
    return {(s.labels["endpoint"], s.labels["status"]): s.value for m in metrics.registry.collect()
            for s in m.samples if s.name == "cascade_edge_requests_total"}


def test_an_unexpected_exception_is_counted_as_the_500_it_answers():
    client, metrics = _app_failing_on_purpose()
    assert client.post("/v1/chat/completions", json={}).status_code == 500
    assert _counts(metrics) == {("chat", "500"): 1}


def test_a_stream_that_fails_after_it_started_is_counted_once_as_failed():
    client, metrics = _app_failing_on_purpose()
    r = client.post("/v1/completions", json={})
    assert r.status_code == 200 and "the backend died" in r.text
    assert _counts(metrics) == {("completions", "500"): 1}
