"""Concurrent requests through the bounded local queue: all complete, none leak a slot."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests import loopback
from tests.conftest import Agent

MODEL = "smollm2-135m"
PROMPTS = [f"Give me one fact about the number {n}." for n in range(8)]


def stream_text(client, prompt, max_tokens=24):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_eight_simultaneous_streams_match_their_sequential_outputs(client):
    sequential = [stream_text(client, p) for p in PROMPTS]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(lambda p: stream_text(client, p), PROMPTS))
    assert concurrent == sequential
    assert all(sequential)


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    """An agent with one slot and room for one request waiting (one agent start for both tests)."""
    a = Agent(tmp_path_factory.mktemp("one-slot"), "--parallel", "1", "--max-waiting", "1", "--n-ctx", "512")
    try:
        yield a.wait_healthy()
    finally:
        a.stop()


def test_disconnect_mid_stream_frees_the_slot(one_slot):
    a = one_slot
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    with loopback.stream("POST", f"{a.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    # the only slot must come back soon, though 400 tokens would take seconds
    deadline = time.monotonic() + 10
    while loopback.get(f"{a.url}/healthz").json()["slots"]["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loopback.get(f"{a.url}/healthz").json()["slots"]["busy"] == 0
    ok = loopback.post(f"{a.url}/v1/chat/completions", timeout=60, json={**body, "stream": False, "max_tokens": 4})
    assert ok.status_code == 200
    metrics = loopback.get(f"{a.url}/metrics").text
    assert 'status="499"' in metrics


def test_full_queue_answers_429_with_retry_after(one_slot):
    a = one_slot
    client = openai.OpenAI(base_url=f"{a.url}/v1", api_key="x", max_retries=0, timeout=60)
    # 64 tokens: ~2 s each here, and the two 429s below come within the first half second
    long_body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
                 "max_tokens": 64, "temperature": 0}
    results = []

    def occupy():
        results.append(loopback.post(f"{a.url}/v1/chat/completions", json=long_body, timeout=60).status_code)

    threads = [threading.Thread(target=occupy) for _ in range(2)]  # one generating, one waiting
    for t in threads:
        t.start()
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while loopback.get(f"{a.url}/healthz").json()["slots"]["waiting"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = loopback.post(f"{a.url}/v1/chat/completions", json=long_body, timeout=60)
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "queue_full"
    try:
        client.chat.completions.create(**long_body)
        raise AssertionError("expected a 429")
    except openai.RateLimitError:
        pass
    for t in threads:
        t.join()
    assert results == [200, 200]  # the admitted requests finish
