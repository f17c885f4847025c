"""Gateway options, on a gateway of their own in front of the shared worker (through a worker that
can slow it down, ``fake_worker``): a metrics key and no tenant labels on /metrics, and a short
idempotency lease that a long request outlives without a duplicate running it again."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest

from tests.conftest import Server, create_key
from tests.integration.fake_worker import FaultyWorker, Mode

MODEL = "smollm2-135m"
METRICS_KEY = "metrics-secret-1"


@pytest.fixture(scope="module")
def worker(cloud_worker):
    w = FaultyWorker(cloud_worker.url).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, worker):
    home = tmp_path_factory.mktemp("gateway-options")
    g = Server(home, ["cloud", "serve"], "--workers", worker.url,
               env={"CASCADE_CLOUD_GATEWAY_METRICS_KEY": METRICS_KEY,
                    "CASCADE_CLOUD_GATEWAY_METRICS_TENANT_LABELS": "false",
                    "CASCADE_CLOUD_GATEWAY_IDEMPOTENCY_LEASE_S": "1"}).wait_healthy(180)
    g.home = home
    yield g
    g.stop()


@pytest.fixture(autouse=True)
def passes_through(worker):
    worker.mode = Mode()
    yield
    worker.mode = Mode()


def client(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=120)


ASK = dict(model=MODEL, messages=[{"role": "user", "content": "Name a planet."}], max_tokens=4, temperature=0.5)


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {METRICS_KEY}", "csk-x"])
def test_metrics_need_the_metrics_key_when_one_is_set(gateway, authorization):
    headers = {"authorization": authorization} if authorization else {}
    r = httpx.get(f"{gateway.url}/metrics", headers=headers, timeout=10)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"


def test_metrics_without_tenant_labels_name_no_tenant(gateway):
    client(gateway, create_key(gateway.home, "--tenant", "secret-corp")).chat.completions.create(**ASK)
    r = httpx.get(f"{gateway.url}/metrics", headers={"authorization": f"Bearer {METRICS_KEY}"}, timeout=10)
    assert r.status_code == 200
    assert "secret-corp" not in r.text and "tenant=" not in r.text
    assert 'cascade_gateway_requests_total{endpoint="chat",outcome="ok"}' in r.text
    assert "cascade_gateway_prompt_tokens_total" in r.text and "cascade_gateway_worker_healthy" in r.text


def test_a_request_running_past_the_idempotency_lease_is_not_run_again(gateway, worker):
    """The lease is 1 s; the request runs about 3 s (a slow worker). A duplicate sent 2 s in
    waits for it and gets its answer: the running request renews its lease."""
    worker.mode = Mode(event_delay_s=0.1)
    c = client(gateway, create_key(gateway.home, "--tenant", "long"))
    ask = {**ASK, "max_tokens": 30, "extra_body": {"ignore_eos": True},
           "extra_headers": {"Idempotency-Key": "long-1"}}
    calls = len(worker.generate_bodies)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(c.chat.completions.with_raw_response.create, **ask)
        time.sleep(2.0)
        assert not first.done()
        second = pool.submit(c.chat.completions.with_raw_response.create, **ask)
        first, second = first.result(), second.result()
    assert len(worker.generate_bodies) - calls == 1  # run once
    assert second.headers.get("x-cascade-idempotent-replay") == "true"
    assert second.parse().choices[0].message.content == first.parse().choices[0].message.content
