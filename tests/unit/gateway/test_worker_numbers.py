"""A worker's numbers before they touch money, buckets or counters (issue 37 items 4 and 11): its
usage checked against what the request could use, a token bucket's debt bounded, its answer read
in bounded lines split on b"\\n" only, and the result cache shared fairly between tenants."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from cascade import errors
from cascade.generation import Finish, TokenEvent
from cloud_tier.gateway.pipeline.flight import Flight, observe_chunk, observe_event
from cloud_tier.gateway.pipeline.result_cache import ResultCache
from cloud_tier.gateway.tenants.keys import ApiKey
from cloud_tier.gateway.tenants.quotas import Limits, Quotas, TokenBucket
from cloud_tier.gateway.workers.stream import ChunkReader, LineReader
from cloud_tier.gateway.workers.usage import UsageBounds, checked, foreign_bounds

BOUNDS = UsageBounds(prompt=100, completion=16)


@pytest.mark.parametrize(("prompt", "completion", "want", "reason"), [
    (9, 3, (9, 3), ""),
    (100, 16, (100, 16), ""),
    (0, 0, (0, 0), ""),
    (10**12, 10**12, (100, 16), "over_bound"),
    (10**400, 1, (100, 1), "over_bound"),
    (-5, 3, None, "negative"),
    (9, -1, None, "negative"),
    (9.5, 3, None, "not_integer"),
    (9.0, 3, None, "not_integer"),
    ("9", 3, None, "not_integer"),
    (True, 3, None, "not_integer"),
    (None, None, None, "not_integer"),
    (float("nan"), 3, None, "not_integer"),
])
def test_a_workers_usage_is_clamped_or_refused(prompt, completion, want, reason):
    assert checked(prompt, completion, BOUNDS) == (want, reason)


def test_a_foreign_requests_bounds_follow_its_prompt_and_max_tokens():
    body = {"messages": [{"role": "user", "content": "x" * 1000}], "max_tokens": 8, "n": 2}
    b = foreign_bounds("chat", body, "user\n" + "x" * 1000 + "\n", 8, None)
    assert 1000 < b.prompt < 1400 and b.completion == 16
    assert foreign_bounds("chat", body, "user\n" + "x" * 1000 + "\n", 8, 512).prompt == 512  # the context
    listed = foreign_bounds("completions", {"prompt": ["a", "b", "c"]}, "a b c", None, 1024)
    assert listed.completion == 3 * 1024  # a choice per prompt, each up to the context


def flight(bounds: UsageBounds, openai: str | None = None) -> Flight:
    key = ApiKey("abcdefgh", "acme", None, frozenset({"infer"}), 0.0, 0.0, 0.0)
    f = Flight("acme", key, "chat", 0.0, bounds=bounds, openai=openai, prompt_tokens=7)
    return f


def test_a_lying_finish_from_our_worker_is_clamped_in_what_is_passed_on_and_stored():
    f = flight(UsageBounds(7, 4))
    observe_event(f, TokenEvent(1, "a", b"a", 0.0, 0.0))
    got = observe_event(f, Finish("stop", -3, 10**12, cached_tokens=10**9))
    assert got == f.finish == Finish("stop", 7, 1, 7)  # refused (negative): our own counts; cached <= prompt
    assert f.usage_problem == "negative" and f.events[-1] == {"finish": ["stop", 7, 1, 7, ""]}
    g = flight(UsageBounds(7, 4))
    assert observe_event(g, Finish("stop", 10**12, 10**12)) == Finish("stop", 7, 4)
    assert g.usage_problem == "over_bound"


def test_a_foreign_chunks_usage_is_replaced_by_what_is_charged():
    f = flight(UsageBounds(50, 8), openai="chunks")
    observe_chunk(f, {"choices": [{"index": 0, "delta": {"content": "Hello there"}, "finish_reason": "stop"}]})
    chunk = observe_chunk(f, {"choices": [], "usage": {"prompt_tokens": 10**400, "completion_tokens": "3"}})
    assert chunk["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}  # the estimates
    assert f.finish == Finish("stop", 7, 2) and f.usage_problem == "not_integer"


def test_a_body_without_usage_gets_the_estimate_of_its_answer():
    f = flight(UsageBounds(50, 200), openai="body")
    body = observe_chunk(f, {"choices": [{"index": 0, "message": {"content": "word " * 80}, "finish_reason": "stop"}]})
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 100, "total_tokens": 107}
    assert f.finish == Finish("stop", 7, 100)


def test_a_bucket_never_owes_more_than_its_capacity():
    now = [0.0]
    bucket = TokenBucket(rate=10.0, capacity=600.0, clock=lambda: now[0])
    bucket.charge(1e12)
    assert bucket.level == -600.0
    assert bucket.wait_for(10) <= 2 * 600 / 10
    quotas = Quotas(clock=lambda: now[0])
    assert quotas.admit("p", "kp", Limits(), Limits(tpm=600), 10).allowed
    quotas.reconcile("p", "kp", 10, 10**12)
    refused = quotas.admit("p", "kp", Limits(), Limits(tpm=600), 10)
    assert not refused.allowed and refused.retry_after_s <= 121
    assert quotas.admit("q", "kq", Limits(), Limits(tpm=600), 10).allowed  # another tenant's bucket


def _reading(parts) -> Callable[[], Awaitable[bytes]]:
    """A worker's answer read as ``parts`` (then b"": its end)."""
    it = iter(parts)

    async def read() -> bytes:
        return next(it, b"")

    return read


async def _lines(parts: list[bytes], limit: int = 64) -> list[bytes]:
    reader, out = LineReader(_reading(parts), limit), []
    while (line := await reader.line()) is not None:
        out.append(line)
    return out


def test_lines_split_on_newline_only_and_are_bounded_while_read():
    got = asyncio.run(_lines([b'data: {"a": "x\xe2\x80\xa8y"}\r', b"\n\ndata: [DO", b"NE]\n", b"tail"]))
    assert got == ['data: {"a": "x\u2028y"}'.encode(), b"", b"data: [DONE]", b"tail"]
    with pytest.raises(errors.APIError) as e:
        asyncio.run(_lines([b"x" * 40, b"x" * 40, b"\n"]))
    assert e.value.status == 502 and e.value.code == "worker_event_too_large"


def test_a_chunk_is_decoded_strictly():
    async def first(*raw: bytes):
        got = await ChunkReader(_reading(raw), 1 << 10).next()
        return None if got is None else got[0]
    assert asyncio.run(first(b'data: {"text": "a\xe2\x80\xa8b"}\n\n')) == {"text": "a\u2028b"}
    assert asyncio.run(first(b"data: [DONE]\n\n")) is None
    for bad in (b'data: {"u": NaN}\n\n', b"data: [1]\n\n", b'data: {"error": {"message": "boom"}}\n\n', b""):
        with pytest.raises(errors.APIError) as e:
            asyncio.run(first(bad))
        assert e.value.status == 502


def test_one_tenant_filling_the_cache_never_evicts_a_smaller_holders_entries():
    """Noisy neighbours on the result cache: P's 1,000 answers leave Q's 3 in place (the largest
    holder loses its own least recently used entries), and a key holds its tenant."""
    cache = ResultCache(max_entries=10, max_bytes=1 << 20)
    for i in range(3):
        cache.put(f"q{i}", i, 10, owner="q")
    for i in range(1000):
        cache.put(f"p{i}", i, 10, owner="p")
    assert [cache.get(f"q{i}") for i in range(3)] == [0, 1, 2]
    assert len(cache) == 10 and cache.get("p999") == 999 and cache.get("p0") is None
    by_bytes = ResultCache(max_entries=100, max_bytes=100)
    by_bytes.put("q", "small", 20, owner="q")
    for i in range(50):
        by_bytes.put(f"p{i}", i, 30, owner="p")
    assert by_bytes.get("q") == "small" and by_bytes.total_bytes <= 100


def test_the_cache_keys_hold_the_tenant():
    from cloud_tier.gateway.foreign.answers import cache_key
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    assert cache_key("p", "chat", body) != cache_key("q", "chat", body)


def test_a_redis_bucket_never_owes_more_than_its_capacity(redis_url):
    import uuid

    from cloud_tier.gateway.tenants.quotas_redis import RedisQuotas

    q = RedisQuotas(redis_url, prefix=f"test:{uuid.uuid4().hex[:8]}:")
    try:
        assert q.admit("p", "kp", Limits(), Limits(tpm=600), 10).allowed
        q.reconcile("p", "kp", 10, 10**12)
        refused = q.admit("p", "kp", Limits(), Limits(tpm=600), 10)
        assert not refused.allowed and refused.retry_after_s <= 121
    finally:
        q.close()
