"""RedisResultCache on a real Redis: a value put by one replica is a hit on another; values are
JSON with an expiry; a value over max_bytes is not stored; a Redis that is down is a miss."""

import logging
import time
import uuid

import pytest
import redis

from cascade.processes import free_port
from cloud_tier.gateway.pipeline.result_cache_redis import RedisResultCache

VALUE = {"events": [{"type": "token", "text": "Paris", "logprob": -0.25}, {"type": "finish", "reason": "stop"}]}


@pytest.fixture
def prefix():
    return f"test:{uuid.uuid4().hex[:8]}:"


@pytest.fixture
def cache(redis_url, prefix):
    opened = []

    def make(**kwargs):
        opened.append(RedisResultCache(redis_url, prefix=prefix, **kwargs))
        return opened[-1]

    yield make
    for c in opened:
        c.close()


def test_a_value_put_on_one_replica_is_a_hit_on_another(cache):
    a, b = cache(), cache()
    assert b.get("k") is None
    a.put("k", VALUE, 100)
    assert b.get("k") == VALUE
    assert (b.stats.hits, b.stats.misses) == (1, 1)
    assert (a.stats.hits, a.stats.misses) == (0, 0)


def test_a_value_lives_ttl_s(cache, redis_url, prefix):
    c = cache(ttl_s=0.3)
    c.put("k", VALUE, 100)
    assert 0 < redis.Redis.from_url(redis_url).pttl(f"{prefix}{{}}:k") <= 300  # owner "": the tag {}
    assert c.get("k") == VALUE
    time.sleep(0.4)
    assert c.get("k") is None


def test_a_value_over_max_bytes_is_not_stored_and_supersedes_the_old_one(cache):
    c = cache(max_bytes=200)
    c.put("k", VALUE, 100)
    big = {"events": [{"type": "token", "text": "x" * 300}]}
    c.put("k", big, 100)  # its JSON is over 200 bytes, whatever size the caller counted
    assert c.get("k") is None
    c.put("k", VALUE, 201)  # and so is a value the caller counts as over
    assert c.get("k") is None


def test_bad_arguments_are_refused(cache):
    with pytest.raises(ValueError):
        cache(ttl_s=0)
    with pytest.raises(ValueError):
        cache().put("k", VALUE, -1)


def test_a_redis_that_is_down_is_a_miss(caplog):
    c = RedisResultCache(f"redis://127.0.0.1:{free_port()}/0")
    with caplog.at_level(logging.WARNING):
        c.put("k", VALUE, 100)
        assert c.get("k") is None
    assert c.stats.misses == 1
    assert "result cache" in caplog.text
    c.close()
