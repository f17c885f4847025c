"""The pipeline's typed result: ``GatewayService.begin`` says which kind of answer it hands back
(a stored answer of ours or of a foreign worker, a live stream of either), and each kind is read
whole (the Batch API) without anyone looking inside it to learn its kind."""

from __future__ import annotations

import asyncio
import hashlib
import json

import httpx
import pytest

from cascade import errors
from cascade.generation import Finish, TokenEvent, event_to_wire
from cascade.openai_format import ChatFormatter
from cascade.protocol import ChatCompletionRequest
from cascade.web import parse_body
from cloud_tier.config import CloudConfig, GatewayConfig
from cloud_tier.gateway.foreign import answers
from cloud_tier.gateway.pipeline.results import (
    CachedAnswer,
    CachedForeignAnswer,
    ForeignStream,
    OwnStream,
    render_stored,
    stored,
)
from cloud_tier.gateway.pipeline.service import GatewayService
from cloud_tier.gateway.pipeline.stores import open_stores
from cloud_tier.gateway.workers.pool import WorkerPool

MODEL = "m"
BODY = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def token(text: str) -> TokenEvent:
    return TokenEvent(token_id=7, text=text, piece=text.encode(), logprob=-0.5, entropy=0.1)


def own_events() -> list:
    return [token("a"), token("b"), Finish("stop", 5, 2)]


async def stream_of(items, closed: list[bool]):
    try:
        for item in items:
            yield item
    finally:
        closed.append(True)


def test_a_stored_record_is_a_foreign_answer_only_when_it_was_stored_with_its_shape():
    ours = stored({"events": [event_to_wire(e) for e in own_events()]}, {"X-Cascade-Cache": "hit"})
    theirs = stored({"events": [BODY], "openai": "body"}, {"X-Cascade-Cache": "hit"})
    assert isinstance(ours, CachedAnswer) and isinstance(theirs, CachedForeignAnswer)
    assert ours.headers == theirs.headers == {"X-Cascade-Cache": "hit"}


def test_a_stored_foreign_answer_is_given_in_the_shape_the_request_wants():
    as_body = CachedForeignAnswer({"events": [BODY], "openai": "body"}, {})
    chunks = answers.response_to_chunks(BODY, "chat")
    as_chunks = CachedForeignAnswer({"events": chunks, "openai": "chunks"}, {})

    async def listed(it):
        return [c async for c in it]

    assert as_body.body("chat") is BODY
    assert asyncio.run(listed(as_body.chunks("chat"))) == chunks
    assert as_chunks.body("chat") == answers.chunks_to_response(chunks, "chat")
    assert asyncio.run(listed(as_chunks.chunks("chat"))) == chunks


def test_each_kind_is_read_whole_as_the_body_a_batch_line_gets():
    fmt = ChatFormatter(MODEL, False)
    record = {"events": [event_to_wire(e) for e in own_events()]}
    closed: list[bool] = []

    cached = asyncio.run(CachedAnswer(record, {}).whole("chat", fmt))
    live = asyncio.run(OwnStream(stream_of(own_events(), closed), {}).whole("chat", fmt))
    assert cached == live == json.loads(render_stored(record, fmt))
    assert live["choices"][0]["message"]["content"] == "ab" and closed == [True]

    foreign = asyncio.run(ForeignStream(stream_of([BODY], closed), {}).whole("chat", fmt))
    assert foreign is BODY and closed == [True, True]
    assert asyncio.run(CachedForeignAnswer({"events": [BODY], "openai": "body"}, {}).whole("chat", fmt)) is BODY


def test_a_foreign_stream_that_gives_no_answer_is_a_502():
    closed: list[bool] = []
    with pytest.raises(errors.APIError) as e:
        asyncio.run(ForeignStream(stream_of([], closed), {}).whole("chat", None))
    assert e.value.status == 502 and e.value.code == "worker_failed" and closed == [True]


@pytest.fixture
def gateway(tmp_path, monkeypatch):
    """A pipeline over a pool with no workers (a hit needs none), of our kind or a foreign one."""
    monkeypatch.setenv("CASCADE_HOME", str(tmp_path))
    opened = []

    def make(kind: str) -> tuple[GatewayService, object]:
        config = CloudConfig(gateway=GatewayConfig(workers="http://127.0.0.1:1"))
        stores = open_stores(config)
        client = httpx.AsyncClient()
        pool = WorkerPool([], client, kind=kind)
        pool.decide_mode()
        opened.append(stores)
        svc = GatewayService(config.gateway, pool, stores, None, MODEL, set(), client)
        _, key = stores.keys.create("acme")
        return svc, key

    yield make
    for stores in opened:
        stores.close()


def request(**extra) -> tuple[dict, ChatCompletionRequest]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "temperature": 0, **extra}
    return body, parse_body(ChatCompletionRequest, dict(body))


def test_a_foreign_pools_hit_and_its_replay_are_stored_foreign_answers_with_their_headers(gateway):
    svc, key = gateway("vllm")
    body, req = request()
    record = {"events": [BODY], "openai": "body"}
    svc.cache.put(answers.cache_key(key.tenant, "chat", body), record, 100, owner=key.tenant)

    hit = asyncio.run(svc.begin(key, "chat", body, req, "idem-1", "rid-1"))
    assert isinstance(hit, CachedForeignAnswer) and hit.record == record
    assert hit.headers == {"X-Cascade-Cache": "hit", "X-Request-Id": "rid-1"}

    replay = asyncio.run(svc.begin(key, "chat", body, req, "idem-1", "rid-2"))
    assert isinstance(replay, CachedForeignAnswer) and replay.record == record
    assert replay.headers == {"X-Cascade-Idempotent-Replay": "true", "X-Cascade-Cache": "miss"}


def test_our_pools_hit_is_a_stored_answer_of_ours(gateway):
    svc, key = gateway("cascade")
    body, req = request()
    record = {"events": [event_to_wire(e) for e in own_events()]}
    seen = (key.tenant, "chat", hashlib.sha256(repr(body).encode()).digest())
    svc.own.cache_keys.put(seen, "the-plans-key", 0, owner=key.tenant)  # as if planned before
    svc.cache.put("the-plans-key", record, 100, owner=key.tenant)

    hit = asyncio.run(svc.begin(key, "chat", body, req, None, "rid-1"))
    assert isinstance(hit, CachedAnswer) and hit.record == record
    assert hit.headers == {"X-Cascade-Cache": "hit"}


def test_a_miss_on_a_pool_with_no_room_is_refused_and_settled(gateway):
    svc, key = gateway("vllm")
    body, req = request(temperature=0.7)  # not cacheable
    with pytest.raises(errors.APIError) as e:
        asyncio.run(svc.begin(key, "chat", body, req, None))
    assert e.value.status in (429, 503)
    refused = [s for s in svc.metrics.registry.collect() if s.name == "cascade_gateway_requests"]
    assert any(sample.value == 1 for metric in refused for sample in metric.samples)
