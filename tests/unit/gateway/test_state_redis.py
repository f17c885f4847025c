"""The request path's state (``pipeline.state``): the same decisions on both backends (in-process
and Redis) for cache hits and misses, quotas and budgets' spend; on Redis ONE round trip per
admission and per settlement; a Redis that answers slowly stalls only the requests waiting on it
(a fault-injecting proxy, tests/fault_proxy.py); garbage in a cache entry is a miss; one
tenant's burst leaves another's decisions as they were."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
import redis

from cloud_tier.gateway.pipeline.result_cache import ResultCache
from cloud_tier.gateway.pipeline.result_cache_redis import RedisResultCache
from cloud_tier.gateway.pipeline.state import Keep, LocalState, Quota
from cloud_tier.gateway.pipeline.state_redis import RedisState
from cloud_tier.gateway.tenants.budgets import RedisSpend
from cloud_tier.gateway.tenants.quotas import Limits, Quotas
from cloud_tier.gateway.tenants.quotas_redis import RedisQuotas
from tests.fault_proxy import FaultProxy

ANSWER = {"events": [{"t": "Red."}]}


class Spend:
    """The key store's spend counters, in memory (LocalState's third part)."""

    def __init__(self):
        self.counts: dict = {}

    async def spent_async(self, counters):
        return [self.counts.get(c, (0.0, 0.0)) for c in counters]

    async def add_spend_async(self, charges):
        for scope, name, pid, tokens, usd, _ in charges:
            t, u = self.counts.get((scope, name, pid), (0.0, 0.0))
            self.counts[(scope, name, pid)] = (t + tokens, u + usd)


def redis_state(url: str) -> RedisState:
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    quotas = RedisQuotas(url, prefix=prefix + "quota:")
    cache = RedisResultCache(url, prefix=prefix + "cache:")
    spend = RedisSpend(url, prefix=prefix + "spend:")
    return RedisState(url, quotas, cache, spend)


@pytest.fixture(params=["local", "redis"])
def make_state(request):
    made = []

    def make():
        if request.param == "local":
            s = LocalState(Quotas(), ResultCache(), Spend())
        else:
            s = redis_state(request.getfixturevalue("redis_url"))
        made.append(s)
        return s

    yield make
    for s in made:
        if isinstance(s, RedisState):
            s.quotas.close()
            s.cache.close()
            s.spend.close()


def counted_trips(s: RedisState) -> list[int]:
    """The commands of each round trip ``s`` makes from now on, as it makes them."""
    trips, real = [], s._pipeline

    async def counted(commands):
        trips.append(len(commands))
        return await real(commands)

    s._pipeline = counted
    return trips


def q(tenant: str, rps: float = 0.0, tpm: float = 0.0, key_rps: float = 0.0) -> Quota:
    return Quota(tenant, f"k-{tenant}", Limits(rps, tpm), Limits(key_rps, 0.0))


def decided(d) -> tuple:
    return (d.allowed, d.reason, d.scope)


def test_hits_misses_and_quotas_decide_alike_on_both_backends(make_state):
    s = make_state()
    tenant = q("acme", rps=2, tpm=60)  # 2 requests a second at most (no refill to speak of in this test)

    async def run():
        out = []
        miss = await s.lookup(tenant, "c1", [])
        out.append(("miss", miss.hit, miss.decision))  # a miss takes nothing
        d, _ = await s.admit(tenant, 50, [])
        out.append(("admit 50", decided(d)))
        d, _ = await s.admit(tenant, 20, [])  # 10 tokens left of 60
        out.append(("admit 20", decided(d)))
        d, _ = await s.admit(tenant, 61, [])  # more than the whole minute
        out.append(("admit 61", decided(d)))
        await s.settle(tenant, 50, 8, [], Keep("c1", ANSWER, 20))  # 42 tokens back, the answer kept
        hit = await s.lookup(tenant, "c1", [])
        out.append(("hit", hit.hit, decided(hit.decision)))  # one request, no tokens
        hit = await s.lookup(tenant, "c1", [])
        out.append(("hit past rps", hit.hit, decided(hit.decision)))
        other = await s.lookup(tenant, "c2", [])
        out.append(("another prompt", other.hit, other.decision))
        return out

    assert asyncio.run(run()) == [
        ("miss", None, None),
        ("admit 50", (True, "", "")),
        ("admit 20", (False, "tpm", "tenant")),
        ("admit 61", (False, "tpm_never", "tenant")),
        ("hit", ANSWER, (True, "", "")),
        ("hit past rps", ANSWER, (False, "rps", "tenant")),
        ("another prompt", None, None),
    ]


def test_spend_is_read_with_the_lookup_and_counted_with_the_settlement(make_state):
    s = make_state()
    tenant, counters = q("acme"), [("tenant", "acme", "2026-12"), ("key", "k-acme", "2026-12")]

    async def run():
        await s.settle(tenant, 0, 0, [("tenant", "acme", "2026-12", 30.0, 0.5, 60.0),
                                      ("key", "k-acme", "2026-12", 30.0, 0.5, 60.0)], None)
        found = await s.lookup(tenant, "none", counters)
        _, spent = await s.admit(tenant, 5, counters)
        return found.spent, spent

    assert asyncio.run(run()) == ([(30.0, 0.5), (30.0, 0.5)], [(30.0, 0.5), (30.0, 0.5)])


def test_one_round_trip_per_lookup_admission_and_settlement(redis_url):
    s = redis_state(redis_url)
    trips = counted_trips(s)
    tenant, counters = q("acme", rps=100, tpm=10_000, key_rps=100), [("tenant", "acme", "2026-12")]

    async def run():
        await s.lookup(tenant, "c1", counters)  # the cache, the quota and the spend
        await s.admit(tenant, 40, counters)
        await s.settle(tenant, 40, 12, [("tenant", "acme", "2026-12", 12.0, 0.0, 60.0)], Keep("c1", ANSWER, 20))
        found = await s.lookup(tenant, "c1", counters)
        await s.aclose()
        return found

    found = asyncio.run(run())
    assert found.hit == ANSWER and found.decision.allowed and found.spent == [(12.0, 0.0)]
    # one pipeline each: script + MGET; true-up + INCRBYFLOAT and EXPIRE of tokens and usd + store
    assert trips == [2, 2, 6, 2]


def test_garbage_in_a_cache_entry_is_a_miss(redis_url):
    s = redis_state(redis_url)
    r = redis.Redis.from_url(redis_url)

    async def run():
        out = []
        for tenant in (q("plain"), q("limited", rps=100)):  # a plain GET, and the script's lookup
            r.set(s.cache.value_key("c1", tenant.tenant), b"{not json")
            found = await s.lookup(tenant, "c1", [])
            out.append((found.hit, found.decision))
        await s.aclose()
        return out

    assert asyncio.run(run()) == [(None, None), (None, None)]
    r.close()


def test_a_burst_of_one_tenant_leaves_another_tenants_decisions_alone(make_state):
    s = make_state()
    noisy, quiet = q("noisy", rps=5), q("quiet", rps=5)

    async def run():
        burst = [decided((await s.admit(noisy, 1, []))[0])[0] for _ in range(50)]
        calm = [decided((await s.admit(quiet, 1, []))[0])[0] for _ in range(5)]
        return burst, calm

    burst, calm = asyncio.run(run())
    assert burst.count(True) <= 6 and calm == [True] * 5


def test_a_slow_redis_stalls_only_the_requests_waiting_on_it(redis_url):
    """Redis behind a proxy that delays every packet by 0.3 s: a lookup waits for it, while the
    event loop keeps serving another tenant's request (embedded, no Redis) at once."""
    host, port = redis_url.split("//")[1].split("/")[0].split(":")
    proxy = FaultProxy(host, int(port))
    slow = redis_state(proxy.url("redis://127.0.0.1:{port}/0"))
    local = LocalState(Quotas(), ResultCache(), Spend())

    async def run():
        await slow.lookup(q("acme", rps=100), "c1", [])  # connected and the script loaded
        proxy.delay_s = 0.3
        started = time.monotonic()
        waiting = asyncio.get_running_loop().create_task(slow.lookup(q("acme", rps=100), "c1", []))
        await asyncio.sleep(0.01)
        quick = []
        for _ in range(20):  # another tenant's requests, each admitted at once meanwhile
            t = time.monotonic()
            await local.lookup(q("other", rps=1000), "x", [])
            await local.admit(q("other", rps=1000), 10, [])
            quick.append(time.monotonic() - t)
            await asyncio.sleep(0.005)
        found = await waiting
        slow_s = time.monotonic() - started
        await slow.aclose()
        return found, slow_s, quick

    try:
        found, slow_s, quick = asyncio.run(run())
    finally:
        proxy.close()
        slow.quotas.close()
        slow.cache.close()
        slow.spend.close()
    assert found.hit is None and slow_s >= 0.55  # its round trip, both ways delayed
    assert max(quick) < 0.05  # never waited for Redis


def test_a_redis_that_is_down_is_a_cache_miss_without_quotas_and_an_error_with_them(redis_url):
    host, port = redis_url.split("//")[1].split("/")[0].split(":")
    proxy = FaultProxy(host, int(port))
    s = redis_state(proxy.url("redis://127.0.0.1:{port}/0"))

    async def run():
        proxy.down()
        found = await s.lookup(q("plain"), "c1", [])
        with pytest.raises(redis.RedisError):
            await s.lookup(q("limited", rps=10), "c1", [])
        await s.settle(q("plain"), 10, 2, [], Keep("c1", ANSWER, 20))  # logged, not raised
        await s.aclose()
        return found

    try:
        found = asyncio.run(run())
    finally:
        proxy.close()
        s.quotas.close()
        s.cache.close()
        s.spend.close()
    assert (found.hit, found.decision) == (None, None)
    assert json.dumps(ANSWER)


def test_a_hit_just_read_is_answered_from_memory_when_nothing_is_to_be_decided(redis_url):
    """The near cache: a tenant with no quota and no budget gets a hit read less than ``near_s``
    ago without a round trip, never past the entry's time to live in Redis; a tenant with a quota
    always goes to Redis (its buckets decide)."""
    s = redis_state(redis_url)
    s.cache.near_s = 0.5
    trips = counted_trips(s)
    r = redis.Redis.from_url(redis_url)

    async def run():
        await s.settle(q("acme"), 0, 0, [], Keep("c1", ANSWER, 20))
        await s.settle(q("lim"), 0, 0, [], Keep("c1", ANSWER, 20))
        r.pexpire(s.cache.value_key("c1", "acme"), 200)  # dies in Redis before near_s is over
        trips.clear()
        found = [await s.lookup(q("acme"), "c1", []) for _ in range(3)]
        assert trips == [1] and all(f.hit == ANSWER for f in found)  # one read, then memory
        await asyncio.sleep(0.3)
        assert (await s.lookup(q("acme"), "c1", [])).hit is None  # gone from Redis: gone here too
        trips.clear()
        limited = [await s.lookup(q("lim", rps=100), "c1", []) for _ in range(3)]
        assert trips == [1, 1, 1] and all(f.hit == ANSWER for f in limited)
        await s.aclose()

    asyncio.run(run())
    r.close()


def test_a_miss_is_admitted_by_its_lookup_in_one_round_trip(make_state):
    """Issue 42: one round trip per request for the quota and the cache, a miss included."""
    s = make_state()
    trips = counted_trips(s) if isinstance(s, RedisState) else []
    tenant = q("acme", rps=100, tpm=100)

    async def run():
        first = await s.lookup(tenant, "m1", [], miss_tokens=60)  # a miss: admitted, 60 of 100 tokens
        second = await s.lookup(tenant, "m1", [], miss_tokens=60)  # 40 left: refused, nothing taken
        third = await s.lookup(tenant, "m1", [], miss_tokens=30)  # 30 of the 40 left
        never = await s.lookup(tenant, "m1", [], miss_tokens=1000)  # more than the whole quota
        return first, second, third, never

    first, second, third, never = asyncio.run(run())
    assert first.admitted and first.hit is None and first.decision.allowed
    assert second.admitted and not second.decision.allowed and second.decision.reason == "tpm"
    assert third.admitted and third.decision.allowed
    assert never.admitted and never.decision.reason == "tpm_never"
    if trips:
        assert trips == [1, 1, 1, 1]  # one script call each: the lookup and the admission together
