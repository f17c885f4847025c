"""The edge agent (a real `cascade edge run` on SmolLM2 / llama.cpp) against a cloud that
misbehaves on purpose (tests/misbehaving.py): captive-portal HTML, cut and malformed streams,
slow first bytes, Retry-After in both forms and absurd values, connection resets at every stage,
a refused key. Both paths: the live escalation and the offline queue's delivery. After each
case: no 5xx from the agent, the breaker is not stuck (a good cloud is used again within
seconds), the local slots are free, and a queued request is done only with a real completion."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests import loopback
from tests.conftest import Agent
from tests.misbehaving import MisbehavingCloud

MODEL = "smollm2-135m"
TIMEOUT_S = 3.0


def agent_env(cloud: MisbehavingCloud, **extra) -> dict:
    env = {"CASCADE_EDGE_UPSTREAM_URL": cloud.url, "CASCADE_EDGE_UPSTREAM_API_KEY": "device-key",
           "CASCADE_EDGE_UPSTREAM_TIMEOUT_S": str(TIMEOUT_S), "CASCADE_EDGE_UPSTREAM_MAX_BACKOFF_S": "0.5",
           "CASCADE_EDGE_UPSTREAM_REFUSED_BACKOFF_S": "1", "CASCADE_EDGE_CASCADE_DEVICE": "kiosk-5",
           "CASCADE_EDGE_SYNC_BASE_BACKOFF_S": "0.1", "CASCADE_EDGE_SYNC_MAX_BACKOFF_S": "0.5",
           "CASCADE_EDGE_SYNC_POLL_S": "0.3"}
    env.update(extra)
    return env


def start(home, cloud, **extra) -> Agent:
    return Agent(home, "--n-ctx", "512", "--threads", "1", "--parallel", "1", "--no-config",
                 env=agent_env(cloud, **extra)).wait_healthy()


@pytest.fixture(scope="module")
def cloud():
    c = MisbehavingCloud().start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def agent(tmp_path_factory, cloud):
    a = start(tmp_path_factory.mktemp("misbehaving"), cloud)
    yield a
    a.stop()


def chat(agent: Agent, stream: bool = False, headers: dict | None = None, max_tokens: int = 4,
         **cascade) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, "cascade": {"mode": "cloud", "offline": "local", **cascade}}
    return loopback.post(f"{agent.url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def health(agent: Agent) -> dict:
    r = loopback.get(f"{agent.url}/healthz", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def settled(agent: Agent, timeout_s: float = 10) -> dict:
    """The agent's slots are all free (nothing leaked by the case), as /healthz says."""
    deadline = time.monotonic() + timeout_s
    while True:
        h = health(agent)
        if h["slots"]["busy"] == 0 and h["slots"]["waiting"] == 0:
            return h
        assert time.monotonic() < deadline, f"a slot stayed busy: {h['slots']}"
        time.sleep(0.1)


def recovers(agent: Agent, cloud: MisbehavingCloud, timeout_s: float = 30) -> None:
    """With the cloud good again, the breaker closes by itself (the delivery loop's probe) and the
    next escalation goes to the cloud: nothing stuck half-open."""
    cloud.set("good")
    deadline = time.monotonic() + timeout_s
    while health(agent)["upstream"]["circuit"] != "closed":
        assert time.monotonic() < deadline, f"circuit stuck: {health(agent)['upstream']}"
        time.sleep(0.1)
    r = chat(agent)
    assert r.status_code == 200 and r.headers["x-cascade-tier"] == "cloud", agent.log.read_text()[-1500:]
    settled(agent)


def sse(r: httpx.Response) -> list:
    lines = [line[5:].strip() for line in r.text.splitlines() if line.startswith("data:")]
    return [json.loads(data) for data in lines if data != "[DONE]"]


BEFORE_FIRST_CHUNK = ["html", "json_not_completion", "empty_stream", "malformed", "error_string", "chunk_not_object",
                      "reset_before_headers", "reset_mid_headers", "server_error_html", "retry_after_negative",
                      "slow_first_byte"]


@pytest.mark.parametrize("behave", BEFORE_FIRST_CHUNK)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_broken_answer_before_the_first_chunk_falls_back_to_the_local_model(agent, cloud, behave, stream):
    cloud.delay_s = TIMEOUT_S + 1.5
    cloud.set(behave)
    r = chat(agent, stream=stream)
    assert r.status_code == 200, r.text
    assert r.headers["x-cascade-tier"] == "edge" and r.headers["x-cascade-degraded"] == "true"
    assert r.headers["x-cascade-reason"] == "cloud_unavailable"
    if stream:
        chunks = sse(r)
        assert not any("error" in c for c in chunks) and chunks[-1]["cascade"]["degraded"] is True
    else:
        assert r.json()["choices"][0]["message"]["content"] is not None
    settled(agent)
    recovers(agent, cloud)


@pytest.mark.parametrize("behave", ["truncated", "bad_choices", "reset_mid_body"])
def test_a_stream_that_breaks_after_it_started_is_an_error_not_a_short_answer(agent, cloud, behave):
    cloud.set(behave)
    r = chat(agent, stream=True)
    if behave == "truncated":  # tokens came first: the stream was committed with them, the error is in-band
        assert r.status_code == 200 and r.headers["x-cascade-tier"] == "cloud"
        chunks = sse(r)
        assert "error" in chunks[-1] and chunks[-1]["error"]["code"] == "upstream_broken", r.text
        assert not any(c.get("choices") and c["choices"][0].get("finish_reason") for c in chunks if "choices" in c)
    else:  # it broke after its role chunk, before any token: our stream had not started, a plain 502
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_broken", r.text
    r = chat(agent, stream=False)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_broken", r.text
    settled(agent)
    recovers(agent, cloud)


def test_a_stream_with_its_finish_reason_but_cut_before_done_is_complete(agent, cloud):
    cloud.set("truncated_after_finish")
    r = chat(agent)
    assert r.status_code == 200 and r.headers["x-cascade-tier"] == "cloud"
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["choices"][0]["message"]["content"] == "Half an answer"
    recovers(agent, cloud)


def test_retry_after_as_an_http_date_is_honoured(agent, cloud):
    cloud.delay_s = 3.0
    cloud.set("retry_after_date")
    r = chat(agent)
    assert r.status_code == 200 and r.headers["x-cascade-tier"] == "edge"
    up = health(agent)["upstream"]
    assert up["circuit"] == "open" and 1.0 < up["retry_after_s"] <= 3.5, up
    recovers(agent, cloud)


def test_a_refused_key_is_its_own_state_not_an_outage(agent, cloud):
    cloud.set("refuse")
    r = chat(agent)
    assert r.status_code == 200 and r.headers["x-cascade-reason"] == "cloud_refused"
    assert r.headers["x-cascade-degraded"] == "true"
    up = health(agent)["upstream"]
    assert up["circuit"] == "refused" and "refused" in up["last_error"], up
    r = chat(agent, offline="fail")
    assert r.status_code == 503 and r.json()["error"]["code"] == "cloud_refused", r.text
    q = chat(agent, offline="queue")
    assert q.status_code == 202 and q.headers["x-cascade-reason"] == "cloud_refused"
    item = q.json()["id"]
    deadline = time.monotonic() + 10
    while "refused" not in (loopback.get(f"{agent.url}/v1/requests/{item}").json()["last_error"] or ""):
        assert time.monotonic() < deadline, loopback.get(f"{agent.url}/v1/requests/{item}").json()
        time.sleep(0.2)
    assert loopback.get(f"{agent.url}/v1/requests/{item}").json()["state"] == "queued"
    log = agent.log.read_text()
    assert "refuses this device" in log
    cloud.set("forbid")  # still refused: no second log line for the same state
    time.sleep(1.5)
    assert agent.log.read_text().count("refuses this device") <= 2  # escalate + delivery each say it once
    recovers(agent, cloud)
    done = wait_final(agent, item)
    assert done["state"] == "done" and done["response"]["choices"][0]["message"]["content"]


def wait_final(agent: Agent, item: str, timeout_s: float = 20) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        got = loopback.get(f"{agent.url}/v1/requests/{item}", timeout=10).json()
        if got["state"] in ("done", "failed", "expired"):
            return got
        assert time.monotonic() < deadline, got
        time.sleep(0.2)


@pytest.mark.parametrize("behave", ["html", "json_not_completion", "sse_for_json", "reset_mid_body",
                                    "server_error_html", "reset_before_headers"])
def test_a_queued_request_is_done_only_with_a_real_completion(agent, cloud, behave):
    cloud.set("reset_before_headers")
    r = chat(agent, offline="queue")
    assert r.status_code == 202, r.text
    item = r.json()["id"]
    cloud.set(behave)  # what the delivery loop meets
    deadline = time.monotonic() + 10
    while (got := loopback.get(f"{agent.url}/v1/requests/{item}").json())["attempts"] < 3:
        assert got["state"] in ("queued", "sending"), got
        assert time.monotonic() < deadline, got
        time.sleep(0.1)
    assert got["last_error"], got
    cloud.set("good")
    done = wait_final(agent, item)
    assert done["state"] == "done" and done["response"]["choices"][0]["message"]["content"] == "The cloud says hi."
    recovers(agent, cloud)


def test_the_probe_wants_a_model_list_not_a_portal_page(agent, cloud):
    # the portal page from the start: a probe while the local answer is still generating (slow
    # on a loaded machine) must not find a real model list and close the circuit early
    cloud.set("reset_before_headers", models="html")
    assert chat(agent).headers["x-cascade-tier"] == "edge"
    cloud.set("good", models="html")  # completions would work, but /v1/models is a portal page
    time.sleep(2.0)
    assert health(agent)["upstream"]["circuit"] != "closed"
    recovers(agent, cloud)


def test_the_apps_idempotency_key_names_its_queued_request_once_the_cloud_is_back(agent, cloud):
    cloud.set("reset_before_headers")
    key = {"Idempotency-Key": f"app-retry-{time.time()}"}
    first = chat(agent, headers=key, offline="queue")
    assert first.status_code == 202
    item = first.json()["id"]
    cloud.set("good")
    assert wait_final(agent, item)["state"] == "done"
    again = chat(agent, headers=key, offline="queue")  # the cloud is back: still the same request
    assert again.status_code == 202 and again.json()["id"] == item
    other = chat(agent, headers=key, offline="queue", max_tokens=5)
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    sent = {p["headers"]["idempotency-key"] for p in cloud.posts() if p["headers"].get("idempotency-key", "")
            .startswith("app-")}
    # live attempts and the delivery used one key derived from the app's: the cloud can run it once
    assert len(sent) == 1


def test_live_escalations_send_a_key_derived_from_the_apps(agent, cloud):
    cloud.set("good")
    key = {"Idempotency-Key": f"live-{time.time()}"}
    n = len(cloud.posts())
    assert chat(agent, headers=key).headers["x-cascade-tier"] == "cloud"
    assert chat(agent, headers=key).headers["x-cascade-tier"] == "cloud"
    keys = [p["headers"]["idempotency-key"] for p in cloud.posts()[n:]]
    assert len(keys) == 2 and keys[0] == keys[1] and keys[0].startswith("app-")
    keys2 = [p["headers"]["idempotency-key"] for p in cloud.posts()[n:]]
    chat(agent)
    assert cloud.posts()[-1]["headers"]["idempotency-key"] not in keys2  # no app key: a fresh one


def test_a_refinement_that_cannot_be_queued_gives_its_slot_back(agent, cloud):
    cloud.set("reset_before_headers")
    for _ in range(3):
        r = chat(agent, refine=True, callback_url="http://203.0.113.9/cb")
        assert r.status_code == 400 and r.json()["error"]["param"] == "cascade.callback_url"
        settled(agent)
    r = chat(agent, mode="local")  # the one slot is free: answered at once
    assert r.status_code == 200
    recovers(agent, cloud)


def test_offline_queue_full_on_a_refinement_gives_the_slot_back(tmp_path, cloud):
    cloud.set("reset_before_headers")
    a = start(tmp_path, cloud, CASCADE_EDGE_SYNC_MAX_ITEMS="1")
    try:
        assert chat(a, offline="queue").status_code == 202  # the queue is full now
        for _ in range(3):
            r = chat(a, refine=True)
            assert r.status_code == 503 and r.json()["error"]["code"] == "offline_queue_full", r.text
            settled(a)
        assert chat(a, mode="local").status_code == 200
    finally:
        a.stop()
        cloud.set("good")


def test_a_low_confidence_escalation_the_cloud_refuses_keeps_the_local_answer(tmp_path, cloud):
    cloud.set("bad_request")
    # every local answer is low-confidence (a mean logprob can never reach 0.5)
    a = start(tmp_path, cloud, CASCADE_EDGE_CASCADE_MIN_MEAN_LOGPROB="0.5", CASCADE_EDGE_CASCADE_HOLD_TOKENS="2")
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6,
                "temperature": 0}
        r = loopback.post(f"{a.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-cascade-tier"] == "edge" and r.headers["x-cascade-reason"].startswith("low_confidence")
        assert any(p["headers"].get("x-cascade-reason") == "low_confidence" for p in cloud.posts())
        settled(a)
    finally:
        a.stop()
        cloud.set("good")


def test_an_absurd_retry_after_is_clamped_and_healthz_still_answers(tmp_path, cloud):
    cloud.set("retry_after_absurd")
    a = start(tmp_path, cloud, CASCADE_EDGE_UPSTREAM_MAX_RETRY_AFTER_S="120")
    try:
        r = chat(a)
        assert r.status_code == 200 and r.headers["x-cascade-tier"] == "edge"
        up = health(a)["upstream"]
        assert up["circuit"] == "open" and 60 < up["retry_after_s"] <= 120, up
        r = chat(a, offline="fail")
        assert r.status_code == 503 and 60 < int(r.headers["retry-after"]) <= 120
    finally:
        a.stop()
        cloud.set("good")
