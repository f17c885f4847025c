"""`cascade cloud serve --prefill 1 --decode 1` through the official `openai` client: the
disaggregated pair gives the engine's greedy output; keys, quotas, KV admission, the result
cache and idempotency hold per tenant; a decode worker killed mid-stream ends the stream."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import openai
import pytest

from cloud_tier.engine import SamplingParams
from tests.conftest import Server, create_key

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "Which city is the capital of France?"}]
# A small KV pool (22 blocks of 16 tokens per worker, 19 under the 0.9 watermark) so that
# admission control is reachable with short requests; a short TTFT objective so that a
# request that cannot start is refused in seconds. A worker refuses a context longer than its
# KV cache holds, so the context is those 352 tokens.
SMALL_KV = str(16 << 20)
SMALL_LEN = "352"


@pytest.fixture(scope="module")
def cloud(engine_home, smollm2_engine):  # the engine fixture has converted the model already
    g = Server(engine_home, ["cloud", "serve"], "--prefill", "1", "--decode", "1", "--model", MODEL,
               "--max-model-len", SMALL_LEN, "--kv-cache-bytes", SMALL_KV,
               env={"CASCADE_CLOUD_GATEWAY_TTFT_SLO_S": "3"}).wait_healthy(300)
    yield g
    g.stop()


@pytest.fixture(scope="module")
def keys(engine_home, cloud):
    return {
        "acme": create_key(engine_home, "--tenant", "acme"),
        "acme_admin": create_key(engine_home, "--tenant", "acme", "--admin"),
        "globex": create_key(engine_home, "--tenant", "globex"),
        "device": create_key(engine_home, "--tenant", "acme", "--device", "kiosk-7"),
        "slow": create_key(engine_home, "--tenant", "initech", "--rps", "2"),
        "small": create_key(engine_home, "--tenant", "hooli", "--tpm", "220"),
    }


def client(cloud, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cloud.url}/v1", api_key=key, max_retries=0, timeout=120)


def test_pair_serves_chat_streamed_and_not(cloud, keys):
    c = client(cloud, keys["acme"])
    r = c.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=24,
                                                    temperature=0, seed=None)
    assert r.headers["x-cascade-tier"] == "cloud"
    full = r.parse()
    assert full.choices[0].message.content.strip() and full.choices[0].finish_reason in ("stop", "length")
    chunks = list(c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"top_p": 0.999}))  # not a cache hit
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_pair_greedy_output_equals_the_engine_alone(cloud, keys, smollm2_engine):
    prompt = "The history of the printing press"
    c = client(cloud, keys["acme"])
    served = c.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, logprobs=2)
    ref = smollm2_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=32))[0]
    assert served.choices[0].text == ref.text
    assert len(served.choices[0].logprobs.top_logprobs) == served.usage.completion_tokens


def test_colocated_gateway_gives_the_same_greedy_output(engine_home, cloud, keys):
    """`--both 1` (prefill and decode in one worker) against the disaggregated pair."""
    g = Server(engine_home, ["cloud", "serve"], "--prefill", "0", "--decode", "0", "--both", "1", "--model", MODEL,
               "--max-model-len", SMALL_LEN, "--kv-cache-bytes", SMALL_KV).wait_healthy(300)
    try:
        ask = dict(model=MODEL, messages=[{"role": "user", "content": "What is the tallest mountain?"}],
                   max_tokens=32, temperature=0)
        both = client(g, keys["acme"]).chat.completions.create(**ask)
        pair = client(cloud, keys["globex"]).chat.completions.create(**ask)
        assert both.choices[0].message.content == pair.choices[0].message.content
        workers = httpx.get(f"{g.url}/healthz").json()["workers"]
        assert [w["role"] for w in workers.values()] == ["both"]
    finally:
        g.stop()


def test_seeded_sampling_continues_across_the_transfer(cloud, keys, smollm2_engine):
    prompt = "Once upon a time"
    c = client(cloud, keys["acme"])
    served = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.9, seed=11)
    ref = smollm2_engine.generate([prompt], SamplingParams(temperature=0.9, seed=11, max_tokens=24))[0]
    assert served.choices[0].text == ref.text


def test_auth_and_scopes(cloud, keys):
    with pytest.raises(openai.AuthenticationError) as e:
        client(cloud, "csk-nope").models.list()
    assert e.value.body["code"] == "invalid_api_key"
    assert [m.id for m in client(cloud, keys["device"]).models.list().data] == [MODEL]
    r = httpx.get(f"{cloud.url}/v1/admin/workers", headers={"authorization": f"Bearer {keys['device']}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
    r = httpx.get(f"{cloud.url}/v1/admin/workers", headers={"authorization": f"Bearer {keys['acme_admin']}"})
    assert r.status_code == 200 and {w["role"] for w in r.json()["data"]} == {"prefill", "decode"}
    r = httpx.post(f"{cloud.url}/v1/admin/keys", json={"device": "kiosk-9"},
                   headers={"authorization": f"Bearer {keys['acme_admin']}"})
    assert r.status_code == 200 and r.json()["tenant"] == "acme" and r.json()["device"] == "kiosk-9"


def test_result_cache_is_per_tenant(cloud, keys):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8, temperature=0)
    a, g = client(cloud, keys["acme"]), client(cloud, keys["globex"])
    first = a.chat.completions.with_raw_response.create(**ask)
    again = a.chat.completions.with_raw_response.create(**ask)
    other = g.chat.completions.with_raw_response.create(**ask)
    assert (first.headers["x-cascade-cache"], again.headers["x-cascade-cache"]) == ("miss", "hit")
    assert other.headers["x-cascade-cache"] == "miss"  # another tenant never reads acme's entry
    assert again.parse().choices[0].message.content == first.parse().choices[0].message.content
    streamed = list(a.chat.completions.create(**ask, stream=True))  # a hit, streamed
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == \
        first.parse().choices[0].message.content
    unseeded = a.chat.completions.with_raw_response.create(**{**ask, "temperature": 0.8})
    assert unseeded.headers["x-cascade-cache"] == "miss"


def test_rps_quota_burst_gets_429_with_retry_after(cloud, keys):
    c = client(cloud, keys["slow"])
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    statuses, retry = [], None
    for _ in range(5):
        try:
            c.chat.completions.create(**ask)
            statuses.append(200)
        except openai.RateLimitError as e:
            statuses.append(429)
            retry = e.response.headers.get("retry-after")
            assert e.body["code"] == "quota_rps"
    assert statuses[:2] == [200, 200] and 429 in statuses
    assert retry is not None and int(retry) >= 1
    client(cloud, keys["globex"]).chat.completions.create(**ask)  # another tenant is unaffected
    time.sleep(1.1)
    c.chat.completions.create(**ask)  # refilled


def test_tpm_quota_and_idempotent_replay_charged_once(cloud, keys):
    """hooli has 220 tokens/min; one answer costs ~60. Three replays of one Idempotency-Key cost
    one answer; a request predicted beyond the whole budget is refused outright."""
    c = client(cloud, keys["small"])
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12,
               temperature=0.7)  # not cacheable: only idempotency may replay it
    texts = []
    for i in range(3):
        r = c.chat.completions.with_raw_response.create(**ask, extra_headers={"Idempotency-Key": "order-1"})
        texts.append(r.parse().choices[0].message.content)
        assert (r.headers.get("x-cascade-idempotent-replay") == "true") == (i > 0)
    assert texts[0] == texts[1] == texts[2]
    streamed = list(c.chat.completions.create(**ask, stream=True, extra_headers={"Idempotency-Key": "order-1"}))
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == texts[0]
    with pytest.raises(openai.RateLimitError) as e:
        c.chat.completions.create(**{**ask, "max_tokens": 300})  # over the 220, within the context
    assert e.value.body["code"] == "tokens_exceed_quota"
    # globex's "order-1" is its own key: it runs, it is not acme's or hooli's replay
    r = client(cloud, keys["globex"]).chat.completions.with_raw_response.create(
        **ask, extra_headers={"Idempotency-Key": "order-1"})
    assert r.headers.get("x-cascade-idempotent-replay") is None
    with pytest.raises(openai.UnprocessableEntityError):  # same key, another request
        c.chat.completions.create(**{**ask, "max_tokens": 13}, extra_headers={"Idempotency-Key": "order-1"})


def test_concurrent_duplicates_run_once(cloud, keys):
    c = client(cloud, keys["globex"])
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=20,
               temperature=1.0)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        rs = list(pool.map(lambda _: c.chat.completions.with_raw_response.create(
            **ask, extra_headers={"Idempotency-Key": "dup-1"}), range(3)))
    texts = {r.parse().choices[0].message.content for r in rs}
    assert len(texts) == 1
    assert sum(r.headers.get("x-cascade-idempotent-replay") == "true" for r in rs) == 2


def test_admission_refuses_what_cannot_fit(cloud, keys):
    c = client(cloud, keys["globex"])
    with pytest.raises(openai.BadRequestError) as e:  # 21 blocks: more than a worker's 19 admissible, never fits
        c.completions.create(model=MODEL, prompt="Hello", max_tokens=330, temperature=0)
    assert e.value.body["code"] == "kv_capacity_exceeded"
    long = dict(model=MODEL, prompt="Tell me a long story.", max_tokens=200, temperature=0,
                extra_body={"ignore_eos": True})  # 13 of the 19 admissible blocks each

    def run(i):
        try:
            r = c.completions.create(**{**long, "prompt": f"{i}. Tell me a long story."})
            return r.usage.completion_tokens
        except openai.RateLimitError as err:
            return err
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(run, 0)
        time.sleep(0.5)
        second = pool.submit(run, 1)
        results = [first.result(), second.result()]
    assert results[0] == 200  # admitted requests finish
    err = results[1]
    assert isinstance(err, openai.RateLimitError), results
    assert err.body["code"] == "kv_capacity" and int(err.response.headers["retry-after"]) >= 1


def test_metrics_per_tenant_and_worker(cloud):
    text = httpx.get(f"{cloud.url}/metrics").text
    assert 'cascade_gateway_requests_total{endpoint="chat",outcome="ok",tenant="acme"}' in text
    assert 'outcome="429_quota_rps",tenant="initech"' in text
    assert 'outcome="cache_hit",tenant="acme"' in text
    assert "cascade_gateway_goodput_requests_total" in text
    assert 'cascade_gateway_worker_kv_blocks_total{role="decode"' in text
    assert "cascade_gateway_worker_prefix_hit_rate" in text


def test_decode_worker_killed_mid_stream_ends_the_stream(engine_home, keys):
    """On a pair of its own, since it kills the decode worker."""
    cloud = Server(engine_home, ["cloud", "serve"], "--prefill", "1", "--decode", "1", "--model", MODEL,
                   "--max-model-len", SMALL_LEN, "--kv-cache-bytes", SMALL_KV).wait_healthy(300)
    try:
        _kill_decode_mid_stream(cloud, keys)
    finally:
        cloud.stop()


def _kill_decode_mid_stream(cloud, keys):
    admin = {"authorization": f"Bearer {keys['acme_admin']}"}
    workers = httpx.get(f"{cloud.url}/v1/admin/workers", headers=admin).json()["data"]
    decode = next(w for w in workers if w["role"] == "decode")
    pid = httpx.get(f"{decode['url']}/healthz").json()["pid"]
    c = client(cloud, keys["acme"])
    stream = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=200, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    received = 0
    with pytest.raises(openai.APIError) as e:
        for _ in stream:
            received += 1
            if received == 3:
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
    assert time.monotonic() - killed < 2.0
    assert "failed" in str(e.value.message) or "failed" in json.dumps(getattr(e.value, "body", "") or "")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        workers = httpx.get(f"{cloud.url}/v1/admin/workers", headers=admin).json()["data"]
        if not next(w for w in workers if w["role"] == "decode")["healthy"]:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the gateway still routes to the dead decode worker")
    with pytest.raises(openai.APIStatusError) as e:  # nowhere to run it: a clear 503, not a hang
        c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0.5)
    assert e.value.status_code == 503



def test_an_int8_pair_started_by_the_gateway_gives_the_int8_engines_greedy_output(engine_home, smollm2_engine):
    """``--kv-cache-dtype int8`` reaches the workers the gateway starts, and their KV moves as stored."""
    from cloud_tier.engine import LLMEngine

    cloud = Server(engine_home, ["cloud", "serve"], "--prefill", "1", "--decode", "1", "--model", MODEL,
                   "--max-model-len", SMALL_LEN, "--kv-cache-bytes", SMALL_KV, "--kv-cache-dtype", "int8",
                   env={"CASCADE_CLOUD_GATEWAY_WORKER_THREADS": "1"}).wait_healthy(300)
    try:
        key = create_key(engine_home, "--tenant", "int8")
        admin = {"authorization": f"Bearer {create_key(engine_home, '--tenant', 'int8', '--admin')}"}
        for w in httpx.get(f"{cloud.url}/v1/admin/workers", headers=admin).json()["data"]:
            card = httpx.get(f"{w['url']}/v1/models").json()["data"][0]
            assert card["meta"]["kv_cache_dtype"] == "int8", (w["role"], card)
        prompt = "The history of the printing press"
        served = client(cloud, key).completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
    finally:
        cloud.stop()
    int8 = LLMEngine.from_model(MODEL, dtype="float32", kv_cache_dtype="int8", max_model_len=352, num_kv_blocks=32,
                                threads=1)
    assert served.choices[0].text == int8.generate([prompt], SamplingParams(temperature=0, max_tokens=32))[0].text
