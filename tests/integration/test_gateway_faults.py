"""A gateway (`cascade cloud serve --workers URL`) in front of the shared real worker, through a
worker that can inject faults (``fake_worker``): what a failure before the first token answers,
which outcome a failure or a hang-up is counted as, what a hang-up is charged, what the result
cache may answer, and whose priority reaches the engine."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Server, create_key
from tests.integration.fake_worker import FaultyWorker, Mode

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def worker(cloud_worker):
    w = FaultyWorker(cloud_worker.url).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, worker):
    home = tmp_path_factory.mktemp("gateway-faults")
    g = Server(home, ["cloud", "serve"], "--workers", worker.url).wait_healthy(180)
    g.home = home
    yield g
    g.stop()


@pytest.fixture(autouse=True)
def passes_through(worker):
    worker.mode = Mode()
    yield
    worker.mode = Mode()


def key_of(gateway, tenant: str, *args: str) -> str:
    return create_key(gateway.home, "--tenant", tenant, *args)


def client(gateway, key: str, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=timeout)


def outcomes(gateway, tenant: str) -> dict[str, float]:
    """cascade_gateway_requests_total of ``tenant`` by outcome."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{gateway.url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "cascade_gateway_requests_total" and s.labels.get("tenant") == tenant and s.value:
                counts[s.labels["outcome"]] = counts.get(s.labels["outcome"], 0) + s.value
    return counts


def wait_for_outcomes(gateway, tenant: str, n: int, timeout_s: float = 15) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = outcomes(gateway, tenant)
        if sum(got.values()) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


ASK = dict(model=MODEL, messages=[{"role": "user", "content": "Which city is the capital of France?"}],
           max_tokens=8, temperature=0.5)

# -- item 16: a failure before the first token is an HTTP error -------------------------------

NO_CAPACITY = Mode(status=503, error={"message": "no KV room on the decode worker", "type": "server_error",
                                      "code": "no_capacity"})


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_no_capacity_before_the_first_token_is_a_503_with_retry_after(gateway, worker, stream):
    worker.mode = NO_CAPACITY
    calls = len(worker.generate_bodies)
    with pytest.raises(openai.APIStatusError) as e:
        r = client(gateway, key_of(gateway, "busy")).chat.completions.create(**ASK, stream=stream)
        list(r) if stream else r
    assert e.value.status_code == 503
    assert int(e.value.response.headers["retry-after"]) >= 1
    assert e.value.body["code"] == "no_capacity" and e.value.body["type"] == "server_error"
    assert len(worker.generate_bodies) - calls == 3  # retried on every attempt first


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_a_workers_400_is_passed_through_as_a_400(gateway, worker, stream):
    worker.mode = Mode(status=400, error={"message": "stop_token_ids must be in the vocabulary",
                                          "type": "invalid_request_error", "param": "stop_token_ids",
                                          "code": "invalid_value"})
    with pytest.raises(openai.BadRequestError) as e:
        r = client(gateway, key_of(gateway, "bad")).chat.completions.create(**ASK, stream=stream)
        list(r) if stream else r
    assert e.value.body["code"] == "invalid_value" and e.value.body["param"] == "stop_token_ids"
    assert "vocabulary" in e.value.body["message"]


# -- the outcome metric records the real cause ----------------------------------------------

def test_a_worker_failing_mid_stream_is_counted_as_a_server_error(gateway, worker):
    worker.mode = Mode(cut_after=3)
    stream = client(gateway, key_of(gateway, "cut")).chat.completions.create(**{**ASK, "max_tokens": 40},
                                                                             stream=True)
    with pytest.raises(openai.APIError):
        list(stream)
    assert wait_for_outcomes(gateway, "cut", 1) == {"5xx": 1}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_a_client_leaving_before_the_first_token_is_counted_as_499(gateway, worker, stream):
    worker.mode = Mode(first_delay_s=3.0)
    tenant = f"gone-{stream}"
    key = key_of(gateway, tenant)
    with pytest.raises(openai.APITimeoutError):
        r = client(gateway, key, timeout=1.0).chat.completions.create(**ASK, stream=stream)
        list(r) if stream else r
    assert wait_for_outcomes(gateway, tenant, 1) == {"499": 1}


# -- item 14: a hang-up is charged the prompt and the tokens sent ----------------------------

def test_hanging_up_mid_stream_is_charged_for_the_prompt_and_the_tokens_sent(gateway, cloud_worker):
    """120 tokens/min (2 a second): read 80 tokens of a 100-token answer and hang up. What is
    left of the minute's budget is then well below a request predicted at the whole budget."""
    key = key_of(gateway, "hangup", "--tpm", "120")
    prompt = "Once upon a time"
    direct = openai.OpenAI(base_url=f"{cloud_worker.url}/v1", api_key="unused", max_retries=0)
    prompt_tokens = direct.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage.prompt_tokens
    c = client(gateway, key)
    started = time.monotonic()
    stream = c.completions.create(model=MODEL, prompt=prompt, max_tokens=100 - prompt_tokens, temperature=0.5,
                                  stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].text)
        if received == 80:
            break
    stream.close()
    assert wait_for_outcomes(gateway, "hangup", 1) == {"499": 1}
    elapsed = time.monotonic() - started
    # charged >= prompt + 80 of the 120; the refill since is 2 tokens a second
    assert elapsed < 35, f"too slow to tell a charge from the refill ({elapsed:.0f} s)"
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=120 - prompt_tokens, temperature=0.5)
    assert e.value.body["code"] == "quota_tpm"


# -- item 15: the result cache keys on the prompt as the model sees it ------------------------

def test_the_result_cache_does_not_answer_a_prompt_that_differs_in_whitespace(gateway, cloud_worker):
    c = client(gateway, key_of(gateway, "sky"))
    direct = openai.OpenAI(base_url=f"{cloud_worker.url}/v1", api_key="unused", max_retries=0, timeout=120)
    asks = [dict(model=MODEL, messages=[{"role": "user", "content": f"Complete the sentence. The sky is{tail}"}],
                 max_tokens=12, temperature=0) for tail in ("\n\n", "")]
    first = c.chat.completions.with_raw_response.create(**asks[0])
    second = c.chat.completions.with_raw_response.create(**asks[1])
    assert (first.headers["x-cascade-cache"], second.headers["x-cascade-cache"]) == ("miss", "miss")
    for ask, got in zip(asks, (first, second), strict=True):
        want = direct.chat.completions.create(**ask).choices[0].message.content
        assert got.parse().choices[0].message.content == want
    again = c.chat.completions.with_raw_response.create(**asks[1], user="someone")  # the same prompt: a hit
    assert again.headers["x-cascade-cache"] == "hit"
    assert again.parse().choices[0].message.content == second.parse().choices[0].message.content


# -- item 17: priority comes from the key; a request may only lower its own -------------------

def _priority_sent(worker, c, **extra) -> int:
    calls = len(worker.generate_bodies)
    c.chat.completions.create(**{**ASK, "max_tokens": 2}, extra_body=extra)
    assert len(worker.generate_bodies) == calls + 1
    return worker.generate_bodies[-1]["record"]["priority"]


def test_priority_comes_from_the_key_and_a_request_may_only_lower_its_own(gateway, worker):
    c = client(gateway, key_of(gateway, "gold", "--priority", "5"))
    assert _priority_sent(worker, c) == 5
    assert _priority_sent(worker, c, priority=7) == 7  # later than the key's: allowed
    assert _priority_sent(worker, c, priority=5) == 5
    with pytest.raises(openai.BadRequestError) as e:  # earlier than the key's: refused
        c.chat.completions.create(**ASK, extra_body={"priority": 4})
    assert e.value.body["param"] == "priority"
    assert _priority_sent(worker, client(gateway, key_of(gateway, "plain"))) == 0  # the default


def test_an_admin_key_may_not_create_a_key_ahead_of_its_own_priority(gateway):
    auth = {"authorization": f"Bearer {key_of(gateway, 'gold', '--priority', '5', '--admin')}"}
    post = lambda body: httpx.post(f"{gateway.url}/v1/admin/keys", json=body, headers=auth, timeout=30)  # noqa: E731
    r = post({"priority": 1})
    assert r.status_code == 403 and r.json()["error"]["param"] == "priority"
    assert post({}).json()["priority"] == 5 and post({"priority": 9}).json()["priority"] == 9
    assert post({"priority": 2**31}).status_code == 400


@pytest.mark.parametrize("priority", [-1_000_000_000, -1, 2**31, 1e300, 1.5, "high", True])
def test_a_priority_out_of_bounds_or_not_an_integer_is_a_400(gateway, worker, priority):
    calls = len(worker.generate_bodies)
    with pytest.raises(openai.BadRequestError) as e:
        client(gateway, key_of(gateway, "cheeky")).chat.completions.create(**ASK, extra_body={"priority": priority})
    assert e.value.body["param"] == "priority" and e.value.body["type"] == "invalid_request_error"
    assert len(worker.generate_bodies) == calls  # never reached the engine


def test_an_infinite_priority_is_a_400_not_a_500(gateway):
    key = key_of(gateway, "cheeky")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "priority": 0})
    body = body.replace('"priority": 0', '"priority": Infinity')
    r = httpx.post(f"{gateway.url}/v1/chat/completions", content=body, timeout=30,
                   headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# -- /metrics stays open, per tenant, by default ----------------------------------------------

def test_metrics_are_open_and_per_tenant_by_default(gateway):
    c = client(gateway, key_of(gateway, "counted"))
    c.chat.completions.create(**{**ASK, "max_tokens": 2})
    assert outcomes(gateway, "counted") == {"ok": 1}
