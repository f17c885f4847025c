"""The result cache in Redis, per tenant (issue 37, noisy neighbour on the result cache): each tenant's
entries are bounded by count and bytes (a sorted set per tenant by when each was stored, trimmed in
the same Lua call that stores), so tenant P writing ten times its bound evicts only its own oldest
entries and never leaves Redis' maxmemory policy a reason to evict tenant Q's: all of Q's still hit."""

import uuid

import pytest

from cloud_tier.gateway.pipeline.result_cache_redis import RedisResultCache


@pytest.fixture
def cache(redis_url):
    opened = []

    def make(**kwargs):
        opened.append(RedisResultCache(redis_url, prefix=f"test:{uuid.uuid4().hex[:8]}:", **kwargs))
        return opened[-1]

    yield make
    for c in opened:
        c.close()


def live_keys(c: RedisResultCache, keys, owner: str = "P") -> int:
    return sum(c._redis.exists(c.value_key(k, owner)) for k in keys)


def test_a_tenant_writing_ten_times_its_bound_evicts_only_its_own_oldest(cache):
    c = cache(tenant_entries=8, tenant_bytes=1 << 20)
    q_keys = [f"q{i}" for i in range(8)]
    for k in q_keys:
        c.put(k, {"text": k}, 20, owner="Q")
    p_keys = [f"p{i}" for i in range(80)]
    for k in p_keys:
        c.put(k, {"text": k}, 20, owner="P")
    assert all(c.get(k, "Q") == {"text": k} for k in q_keys)
    assert live_keys(c, p_keys) == 8 and all(c.get(k, "P") is not None for k in p_keys[-8:])  # P's newest kept
    assert c.get("p0", "P") is None


def test_a_tenant_past_its_bytes_evicts_its_own_and_nothing_over_the_bound_is_stored(cache):
    c = cache(tenant_entries=1000, tenant_bytes=10_000)
    c.put("q", {"text": "q" * 100}, 100, owner="Q")
    for i in range(40):
        c.put(f"p{i}", {"text": "p" * 1000}, 1000, owner="P")
    assert c.get("q", "Q") == {"text": "q" * 100}
    assert 8 <= live_keys(c, [f"p{i}" for i in range(40)]) <= 10
    c.put("huge", {"text": "h" * 20_000}, 20_000, owner="P")  # over the tenant's bound: not stored
    assert c.get("huge", "P") is None and c.get("p39", "P") is not None


def test_replacing_a_key_counts_it_once(cache):
    c = cache(tenant_entries=3, tenant_bytes=1 << 20)
    for _ in range(10):
        c.put("same", {"v": 1}, 10, owner="P")
    c.put("a", {"v": 2}, 10, owner="P")
    c.put("b", {"v": 3}, 10, owner="P")
    assert c.get("same", "P") == {"v": 1} and c.get("a", "P") and c.get("b", "P")
