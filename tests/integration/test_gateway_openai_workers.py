"""The gateway in front of OpenAI-compatible workers (`--worker-type openai`): our real worker's
OpenAI API behind fault-injecting proxies. Requests go through unchanged, usage comes from the
worker, failures before the first byte are retried elsewhere, a dead or stalled worker stops
getting traffic, and every failure is a clean OpenAI error, never a hang."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.conftest import Server, create_key, gateway_count
from tests.integration.faulty_openai import FaultyOpenAIWorker

CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def proxies(cloud_worker):
    ws = [FaultyOpenAIWorker(cloud_worker.url).start() for _ in range(2)]
    yield ws
    for w in ws:
        w.stop()


@pytest.fixture(autouse=True)
def healthy_proxies(proxies):
    for w in proxies:
        w.mode = type(w.mode)()
        w.bodies.clear()
        w.request_ids.clear()
    yield


def gateway(home, *urls: str, env: dict | None = None) -> Server:
    return Server(home, ["cloud", "serve"], "--workers", ",".join(urls), "--worker-type", "openai",
                  env={"CASCADE_CLOUD_GATEWAY_RETRY_BACKOFF_S": "0.05", **(env or {})}).wait_healthy(60)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, proxies):
    home = tmp_path_factory.mktemp("gw-openai")
    g = gateway(home, *(w.url for w in proxies))
    g.home = home
    yield g
    g.stop()


def client_of(g, tenant: str, *args: str, timeout: float = 60) -> openai.OpenAI:
    key = create_key(g.home, "--tenant", tenant, *args)
    return openai.OpenAI(base_url=f"{g.url}/v1", api_key=key, max_retries=0, timeout=timeout)


def test_the_openai_client_streams_and_not_through_openai_workers(pair):
    c = client_of(pair, "oa-basic")
    whole = c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content and whole.usage.completion_tokens > 0
    chunks = list(c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole.choices[0].message.content
    assert all(ch.usage is None for ch in chunks)  # not asked for: the usage the gateway forced is not passed on
    with_usage = list(c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=12, temperature=0.7,
                                                stream=True, stream_options={"include_usage": True}))
    assert with_usage[-1].usage is not None and with_usage[-1].usage.completion_tokens > 0
    text = c.completions.create(model="smollm2-135m", prompt="One, two,", max_tokens=5, temperature=0)
    assert text.choices[0].text is not None and text.usage.prompt_tokens > 0


def test_the_worker_gets_the_body_unchanged_but_for_usage_and_a_request_id(pair, proxies):
    c = client_of(pair, "oa-body")
    before = sum(len(w.bodies) for w in proxies)
    c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=4, temperature=0.5, stream=True,
                              extra_body={"top_k": 3, "ignore_eos": True}, extra_headers={"X-Request-Id": "rid-42"})
    sent = [b for w in proxies for b in w.bodies][before:]
    ids = [i for w in proxies for i in w.request_ids][before:]
    assert len(sent) == 1 and ids == ["rid-42"]
    assert sent[0]["top_k"] == 3 and sent[0]["ignore_eos"] is True and sent[0]["messages"] == CHAT
    assert sent[0]["stream_options"] == {"include_usage": True}
    r = httpx.post(f"{pair.url}/v1/chat/completions", headers={"authorization": f"Bearer {c.api_key}",
                                                               "x-request-id": "rid-43"},
                   json={"model": "smollm2-135m", "messages": CHAT, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "rid-43"


def test_quotas_are_charged_the_workers_real_usage(pair):
    c = client_of(pair, "oa-usage")
    r = c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=6, temperature=0.3, stream=True,
                                  stream_options={"include_usage": True})
    usage = list(r)[-1].usage
    deadline = time.monotonic() + 10
    while gateway_count(pair, "oa-usage", "cascade_gateway_prompt_tokens_total") == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gateway_count(pair, "oa-usage", "cascade_gateway_prompt_tokens_total") == usage.prompt_tokens
    assert gateway_count(pair, "oa-usage", "cascade_gateway_completion_tokens_total") == usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_worker_answering_503_is_retried_on_another_before_the_first_byte(pair, proxies, stream):
    c = client_of(pair, f"oa-retry-{stream}")
    proxies[0].mode.status = proxies[1].mode.status = 200
    for _ in range(4):  # whichever is chosen first, a 503 there is answered by the other
        proxies[0].mode.status = 503
        out = c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=3, stream=stream)
        if stream:
            out = list(out)
        assert out
    assert proxies[1].bodies  # the healthy one answered


def test_a_workers_400_passes_through_and_is_not_retried(pair, proxies):
    c = client_of(pair, "oa-400")
    for w in proxies:
        w.mode.status = 400
        w.mode.error = {"message": "bad logit_bias", "type": "invalid_request_error", "param": "logit_bias",
                        "code": "invalid_value"}
    before = sum(len(w.bodies) for w in proxies)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=3)
    assert "bad logit_bias" in str(e.value) and sum(len(w.bodies) for w in proxies) == before + 1


def test_a_worker_answering_html_is_a_clean_502(pair, proxies):
    c = client_of(pair, "oa-html")
    for w in proxies:
        w.mode.html = True
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=3)
    assert e.value.status_code == 502


def test_a_stream_cut_mid_way_ends_with_an_error_event(pair, proxies):
    c = client_of(pair, "oa-cut")
    for w in proxies:
        w.mode.cut_after = 2
    r = httpx.post(f"{pair.url}/v1/chat/completions", headers={"authorization": f"Bearer {c.api_key}"},
                   json={"model": "smollm2-135m", "messages": CHAT, "max_tokens": 16, "stream": True,
                         "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    events = [ln for ln in r.text.splitlines() if ln.startswith("data:")]
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_our_worker_behind_the_openai_path_keeps_x_cascade_deadline(pair, proxies, stream):
    """Issue 37 item 7: the deadline reaches the worker (ours ends its answer there, finish
    "length", a clean 200) instead of all 200 tokens (~12 s here)."""
    c = client_of(pair, f"oa-deadline-{stream}")
    t0 = time.monotonic()
    ask = dict(model="smollm2-135m", messages=CHAT, max_tokens=200, temperature=0.5,
               extra_body={"ignore_eos": True}, extra_headers={"X-Cascade-Deadline": "1"})
    if stream:
        chunks = list(c.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
        finish, used = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1], chunks[-1].usage
    else:
        r = c.chat.completions.create(**ask)
        finish, used = r.choices[0].finish_reason, r.usage
    assert time.monotonic() - t0 < 6 and finish == "length" and used.completion_tokens < 200
    assert 0 < float([h for w in proxies for h in w.headers][-1]["x-cascade-deadline"]) <= 1


def test_replays_and_cache_hits_come_back_in_the_shape_asked_for(pair):
    c = client_of(pair, "oa-replay")
    args = dict(model="smollm2-135m", messages=CHAT, max_tokens=8, temperature=0)
    first = c.chat.completions.create(**args, extra_headers={"Idempotency-Key": "k1"})
    replay = list(c.chat.completions.create(**args, stream=True, extra_headers={"Idempotency-Key": "k1"}))
    assert "".join(ch.choices[0].delta.content or "" for ch in replay if ch.choices) == first.choices[0].message.content
    raw = c.chat.completions.with_raw_response.create(**args)  # same body, no key: the result cache
    assert raw.headers["x-cascade-cache"] == "hit" and raw.parse().choices[0].message.content == \
        first.choices[0].message.content


def test_a_dead_worker_stops_receiving_traffic(tmp_path, proxies):
    from cascade.processes import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    g = gateway(tmp_path, dead, proxies[0].url)
    g.home = tmp_path
    try:
        c = client_of(g, "oa-dead")
        for _ in range(4):
            assert c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=2).choices
        workers = httpx.get(f"{g.url}/healthz", timeout=10).json()["workers"]
        assert workers[dead]["healthy"] is False and workers[proxies[0].url]["healthy"] is True
    finally:
        g.stop()


def test_a_stalled_worker_fails_fast_and_its_breaker_opens(tmp_path, proxies):
    w = proxies[0]
    g = gateway(tmp_path, w.url, env={"CASCADE_CLOUD_GATEWAY_FIRST_TOKEN_TIMEOUT_S": "1",
                                      "CASCADE_CLOUD_GATEWAY_BREAKER_THRESHOLD": "2",
                                      "CASCADE_CLOUD_GATEWAY_BREAKER_OPEN_S": "2"})
    g.home = tmp_path
    try:
        c = client_of(g, "oa-stall", timeout=30)
        w.mode.stall_s = 20
        for _ in range(2):
            t0 = time.monotonic()
            with pytest.raises(openai.APIStatusError) as e:
                list(c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=2, stream=True))
            assert e.value.status_code == 504 and time.monotonic() - t0 < 10
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:  # the breaker is open: no traffic, an answer at once
            c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=2)
        assert e.value.status_code == 503 and time.monotonic() - t0 < 2
        w.mode.stall_s = 0
        time.sleep(2.2)  # half-open: one trial, which succeeds and closes it
        assert c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=2).choices
    finally:
        g.stop()


@pytest.fixture
def pd_pair(tmp_path, proxies):
    prefill, decode = proxies
    g = Server(tmp_path, ["cloud", "serve"], "--prefill", prefill.url, "--decode", decode.url, "--kv-connector", "nixl",
               "--worker-type", "openai").wait_healthy(60)
    g.home = tmp_path
    yield g, prefill, decode
    g.stop()


LONG = [{"role": "system", "content": "You answer briefly. " * 80}, {"role": "user", "content": "Name a colour."}]


def test_a_pd_pair_prefills_with_one_token_then_decodes_with_the_returned_params(pd_pair):
    g, prefill, decode = pd_pair
    params = {"remote_engine_id": "e1", "remote_block_ids": [1, 2], "remote_host": "10.0.0.1", "remote_port": 5600,
              "do_remote_prefill": True, "do_remote_decode": False}
    prefill.mode.kv_params = params
    c = client_of(g, "oa-pd")
    chunks = list(c.chat.completions.create(model="smollm2-135m", messages=LONG, max_tokens=6, stream=True,
                                            extra_headers={"X-Request-Id": "pd-1"}))
    assert any(ch.choices and ch.choices[0].delta.content for ch in chunks)
    (p,), (d,) = prefill.bodies, decode.bodies
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True and p["messages"] == LONG
    assert d["kv_transfer_params"] == params and d["max_tokens"] == 6 and d["stream"] is True
    assert prefill.request_ids == decode.request_ids == ["pd-1"]


def test_a_short_prompt_skips_the_prefill_and_a_failed_prefill_decodes_alone(pd_pair):
    g, prefill, decode = pd_pair
    c = client_of(g, "oa-pd-skip")
    assert c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=3).choices
    assert prefill.bodies == [] and len(decode.bodies) == 1
    prefill.mode.status = 500
    assert c.chat.completions.create(model="smollm2-135m", messages=LONG, max_tokens=3).choices
    assert len(prefill.bodies) == 1 and "kv_transfer_params" not in decode.bodies[-1]


def _in_flight(g, admin_key: str) -> dict[str, tuple[int, int]]:
    data = httpx.get(f"{g.url}/v1/admin/workers", headers={"authorization": f"Bearer {admin_key}"}, timeout=10).json()
    return {w["url"]: (w["in_flight"], w["committed_blocks"]) for w in data["data"]}


def test_clients_that_hang_up_at_every_stage_leave_nothing_held(pair, proxies):
    admin = create_key(pair.home, "--tenant", "oa-hangup", "--admin")
    body = {"model": "smollm2-135m", "messages": CHAT, "max_tokens": 64, "stream": True, "ignore_eos": True}
    headers = {"authorization": f"Bearer {admin}"}
    for w in proxies:
        w.mode.stall_s = 1.0  # hang up before the first byte
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{pair.url}/v1/chat/completions", headers=headers, json=body, timeout=0.3)
    for w in proxies:
        w.mode.stall_s = 0
    with httpx.stream("POST", f"{pair.url}/v1/chat/completions", headers=headers, json=body, timeout=60) as r:
        for line in r.iter_lines():  # hang up after the first chunk
            if line.startswith("data:"):
                break
    for w in proxies:
        w.mode.stall_s = 1.0
    with pytest.raises(httpx.ReadTimeout):  # not streamed, gone while it runs
        httpx.post(f"{pair.url}/v1/chat/completions", headers=headers, json={**body, "stream": False}, timeout=0.3)
    deadline = time.monotonic() + 15
    while any(v != (0, 0) for v in _in_flight(pair, admin).values()):
        assert time.monotonic() < deadline, _in_flight(pair, admin)
        time.sleep(0.2)
