"""Issue 37 items 1 and 3: one tenant's request that its worker refuses never takes the pool from
another tenant. The real gateway (in process) in front of one model-free OpenAI-compatible
worker that fails only requests whose text says "poison" (a 500 with an OpenAI error body, as
vLLM answers a request it chokes on), or refuses them with a 429; a worker that really is down
(503 for everyone) still opens its breaker."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fastapi.responses import JSONResponse, StreamingResponse

from tests.integration.batch_fakes import MODEL, FakeOpenAIWorker, InProcessGateway, answer_of, refuse


def _text(body: dict) -> str:
    return " ".join(str(m.get("content")) for m in body.get("messages") or () if isinstance(m, dict))


@pytest.fixture(scope="module")
def worker():
    w = FakeOpenAIWorker().start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, worker):
    # the defaults that matter here: retries 2, a breaker opened by 3 failures in a row
    g = InProcessGateway(tmp_path_factory.mktemp("poison"), worker.url, retry_backoff_s=0.01,
                         breaker_threshold=3, breaker_open_s=5.0).start()
    g.alice, g.bob = g.key("alice"), g.key("bob")
    yield g
    g.stop()


@pytest.fixture(autouse=True)
def honest(worker):
    worker.hook = None
    yield
    worker.hook = None


def ask(g, key: str, text: str, stream: bool = False) -> httpx.Response:
    return httpx.post(f"{g.url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=20,
                      json={"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4,
                            "temperature": 0.5, "stream": stream})


def streamed(body: dict) -> StreamingResponse:
    """The fake's answer as a stream (it answers JSON only): its chunk, the usage chunk, [DONE]."""
    whole = answer_of(body)
    base = {k: whole[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    chunks = [{**base, "choices": [{"index": 0, "delta": whole["choices"][0]["message"], "finish_reason": "stop"}]},
              {**base, "choices": [], "usage": whole["usage"]}]
    return StreamingResponse(iter([*(f"data: {json.dumps(c)}\n\n" for c in chunks), "data: [DONE]\n\n"]),
                             media_type="text/event-stream")


def poisoned(status: int, error: dict | None):
    async def hook(body):
        if "poison" not in _text(body):
            return streamed(body) if body.get("stream") else None
        if error is None:
            return JSONResponse(["not an error body"], status_code=status)
        return JSONResponse({"error": error}, status_code=status)
    return hook


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_one_tenants_poison_requests_never_shut_another_tenant_out(gateway, worker, stream):
    worker.hook = poisoned(500, {"message": "the prompt broke the tokenizer", "type": "server_error",
                                 "param": None, "code": "internal_error"})
    before = len(worker.bodies)
    for _ in range(4):  # back to back, as an edge device retrying one poison request would
        r = ask(gateway, gateway.alice, "poison me", stream)
        assert r.status_code >= 500 and r.json()["error"]["message"], r.text[:300]
        good = ask(gateway, gateway.bob, "Name a colour.", stream)
        assert good.status_code == 200, good.text[:300]
    # each poison request went to the one worker once (a retry there cannot help), Bob's once each
    assert len(worker.bodies) - before == 8


def test_a_worker_429_is_a_rate_limit_error_tried_once_with_its_retry_after(gateway, worker):
    async def hook(body):
        return JSONResponse({"error": {"message": "too many requests"}}, status_code=429,
                            headers={"retry-after": "7"})
    worker.hook = hook
    before = len(worker.bodies)
    r = ask(gateway, gateway.alice, "hello")
    assert r.status_code == 429 and r.headers["retry-after"] == "7", r.text[:300]
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and set(err) >= {"message", "type", "param", "code"}
    assert len(worker.bodies) - before == 1  # one worker: not retried against the same one


def test_a_worker_down_for_everyone_still_opens_its_breaker(tmp_path, worker):
    g = InProcessGateway(tmp_path, worker.url, retry_backoff_s=0.01, breaker_threshold=3,
                         breaker_open_s=30.0).start()
    try:
        key = g.key("carol")
        worker.hook = lambda body: refuse(503, "overloaded")
        for _ in range(3):
            assert ask(g, key, "hi").status_code == 503
        before = len(worker.bodies)
        t0 = time.monotonic()
        r = ask(g, key, "hi")
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers", r.text[:300]
        assert len(worker.bodies) == before and time.monotonic() - t0 < 2  # the breaker answered, not the worker
    finally:
        g.stop()


def test_answers_that_are_not_openai_shaped_open_the_breaker_too(tmp_path, worker):
    g = InProcessGateway(tmp_path, worker.url, retry_backoff_s=0.01, breaker_threshold=3,
                         breaker_open_s=30.0).start()
    try:
        key = g.key("dave")
        worker.hook = poisoned(500, None)  # a 500 whose body is not an OpenAI error: the worker is broken
        for _ in range(3):
            assert ask(g, key, "poison").status_code >= 500
        r = ask(g, key, "hi")
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers", r.text[:300]
    finally:
        g.stop()
