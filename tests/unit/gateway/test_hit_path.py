"""The cache-hit path's shortcuts give what the long way gives: a stored answer's body, work that
runs only while its caller is connected, a request body read as JSON, a value from Redis, the
metrics' children."""

from __future__ import annotations

import asyncio
import json
import uuid

import anyio
import pytest
from starlette.requests import Request

from cascade import errors
from cascade.generation import Finish, TokenEvent, event_to_wire
from cascade.openai_format import ChatFormatter, CompletionFormatter
from cascade.web.caller import CallerGone, while_connected
from cascade.web.requests import read_json
from cloud_tier.gateway.pipeline.metrics import GatewayMetrics
from cloud_tier.gateway.pipeline.result_cache_redis import RedisResultCache
from cloud_tier.gateway.pipeline.results import render_stored

MODEL = "smollm2-135m"


def token(text: str, logprob: float = -0.5) -> TokenEvent:
    return TokenEvent(token_id=7, text=text, piece=text.encode(), logprob=logprob, entropy=0.1)


def stored(*texts: str) -> dict:
    return {"events": [event_to_wire(e) for e in (*map(token, texts), Finish("stop", 5, len(texts)))]}


def rendered_the_long_way(result: dict, fmt) -> bytes:
    """The body as the gateway rendered a stored answer before it kept a template: the response of
    a formatter of its own (a formatter counts text offsets), dumped with ``fmt``'s id and time."""
    from cascade.generation import event_from_wire

    events = [event_from_wire(e) for e in result["events"]]
    body = type(fmt)(MODEL, fmt.logprobs).response(events[:-1], events[-1]).model_dump(exclude_none=True)
    return json.dumps({**body, "id": fmt.id, "created": fmt.created}, separators=(",", ":")).encode()


@pytest.mark.parametrize("fmt", [lambda: ChatFormatter(MODEL, False), lambda: ChatFormatter(MODEL, True),
                                 lambda: CompletionFormatter(MODEL, None), lambda: CompletionFormatter(MODEL, 2)],
                         ids=["chat", "chat-logprobs", "completion", "completion-logprobs"])
def test_a_stored_answer_renders_as_the_formatters_body_with_a_fresh_id_and_time(fmt):
    result = stored("100% ", "sûr, ", '"%(id)s" ', "%s\n")  # what a template could trip on
    first, second = fmt(), fmt()
    second.created += 7
    assert render_stored(result, first) == rendered_the_long_way(result, first)
    assert render_stored(result, second) == rendered_the_long_way(result, second)  # from the template now
    assert json.loads(render_stored(result, second))["id"] == second.id != first.id


def receiver(disconnect_after_s: float | None):
    """An ASGI receive channel whose body was read; it says http.disconnect after the delay
    (None: never)."""
    async def receive():
        if disconnect_after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_after_s)
        return {"type": "http.disconnect"}
    return Request({"type": "http", "method": "POST", "headers": [], "path": "/"}, receive)


def test_work_runs_in_the_callers_task_even_across_a_task_bound_context():
    async def work():
        mine = asyncio.current_task()
        with anyio.CancelScope():  # httpx enters these: entered and exited in one task
            await asyncio.sleep(0.01)
        return mine

    async def run():
        return await while_connected(receiver(None), work()), asyncio.current_task()
    ran_in, caller = asyncio.run(run())
    assert ran_in is caller


def test_a_failure_of_work_that_never_waits_is_raised_as_it_is():
    async def work():
        raise errors.bad_request("no", "model")

    with pytest.raises(errors.APIError) as e:
        asyncio.run(while_connected(receiver(None), work()))
    assert e.value.param == "model"


def test_work_that_waits_is_resumed_until_its_result_or_its_failure():
    async def work(fail: bool):
        await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        fut = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, fut.set_result, 41)
        value = await fut
        if fail:
            raise ValueError(value)
        return value + 1

    assert asyncio.run(while_connected(receiver(None), work(False))) == 42
    with pytest.raises(ValueError, match="41"):
        asyncio.run(while_connected(receiver(None), work(True)))


def test_work_that_waits_is_cancelled_when_its_caller_leaves():
    cancelled = []

    async def work():
        await asyncio.sleep(0)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def run():
        with pytest.raises(CallerGone):
            await while_connected(receiver(0.05), work())
        await asyncio.sleep(0.01)  # the caller's task goes on, not cancelled itself
        return asyncio.current_task().cancelling()
    assert asyncio.run(run()) == 0
    assert cancelled == [True]


def test_work_that_goes_on_after_its_caller_left_still_answers_caller_gone():
    async def work():
        await asyncio.sleep(0)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return "finished for nobody"

    async def run():
        with pytest.raises(CallerGone):
            await while_connected(receiver(0.05), work())
        return asyncio.current_task().cancelling()
    assert asyncio.run(run()) == 0


def test_work_that_waits_is_cancelled_with_the_handler():
    cancelled = []

    async def work():
        await asyncio.sleep(0)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def run():
        handler = asyncio.ensure_future(while_connected(receiver(None), work()))
        await asyncio.sleep(0.05)
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler
        await asyncio.sleep(0)  # the work's task sees its cancellation
    asyncio.run(run())
    assert cancelled == [True]


def body_request(raw: bytes) -> Request:
    sent = []

    async def receive():
        if sent:
            await asyncio.Event().wait()
        sent.append(True)
        return {"type": "http.request", "body": raw, "more_body": False}
    return Request({"type": "http", "method": "POST", "headers": [], "path": "/"}, receive)


def read(raw: bytes):
    return asyncio.run(read_json(body_request(raw), 1 << 20))


@pytest.mark.parametrize("raw,code", [
    ('\ufeff{"a": 1}'.encode(), "invalid_json"),  # a BOM: what json.loads says of it
    (b'{"a": NaN}', "invalid_json"),
    (b'{"a": 1e999}', "invalid_json"),
    (b'{"a": "\\ud800"}', "invalid_encoding"),
    (b'{"a": "x\\uDFFFy"}', "invalid_encoding"),
    (b'{"a": "\\ude00\\ud83d"}', "invalid_encoding"),  # a pair the wrong way round
    (b'{"a": "\xed\xa0\x80"}', "invalid_encoding"),  # a surrogate in UTF-8: not UTF-8
    (b"[1]", "invalid_json"),
    (b'{"a": 1', "invalid_json"),
])
def test_a_bad_body_is_refused_as_before(raw, code):
    with pytest.raises(errors.APIError) as e:
        read(raw)
    assert (e.value.status, e.value.code) == (400, code)
    if raw.startswith(b"\xef\xbb\xbf"):
        with pytest.raises(json.JSONDecodeError) as plain:
            json.loads(raw.decode())
        assert str(plain.value) in e.value.message


@pytest.mark.parametrize("raw,value", [
    (b'{"a": "\\ud83d\\ude00"}', "\U0001F600"),  # a pair: one character
    (b'{"a": "\\\\ud800"}', "\\ud800"),  # an escaped backslash, then text
    (b'{"a": "\\u00e9\\u4e2d"}', "é中"),
    (b'{"a": "100%"}', "100%"),
])
def test_escapes_that_make_no_lone_surrogate_are_read(raw, value):
    assert read(raw) == {"a": value}


def test_a_value_redis_gives_again_is_the_one_decoded_before_until_it_changes(redis_url):
    import redis

    prefix = f"test:{uuid.uuid4().hex[:8]}:"
    cache, other_replica = RedisResultCache(redis_url, prefix=prefix), redis.Redis.from_url(redis_url)
    try:
        cache.put("k", {"events": [{"t": 1}]}, 10)
        first = cache.get("k")
        first["json_template"] = "{}"  # what render_stored keeps on it
        assert cache.get("k") is first
        other_replica.set(cache.value_key("k", ""), json.dumps({"events": [{"t": 2}]}))  # another answer stored
        assert cache.get("k") == {"events": [{"t": 2}]}
        other_replica.delete(cache.value_key("k", ""))
        assert cache.get("k") is None
        assert (cache.stats.hits, cache.stats.misses) == (3, 1)
    finally:
        cache.close()
        other_replica.close()


@pytest.mark.parametrize("tenant_labels", [True, False])
def test_counts_go_to_the_children_labels_would_give(tenant_labels):
    m = GatewayMetrics(tenant_labels)
    for _ in range(3):
        m.of(m.requests, "acme", "chat", "cache_hit").inc()
    m.of(m.tokens_in, "acme").inc(5)
    m.cache_lookup(True)
    m.cache_lookup(False)
    m.cache_lookup(False)
    t = {"tenant": "acme"} if tenant_labels else {}
    sample = m.registry.get_sample_value
    assert sample("cascade_gateway_requests_total", {**t, "endpoint": "chat", "outcome": "cache_hit"}) == 3
    assert sample("cascade_gateway_prompt_tokens_total", t) == 5
    assert sample("cascade_gateway_result_cache_total", {"result": "hit"}) == 1
    assert sample("cascade_gateway_result_cache_total", {"result": "miss"}) == 2
