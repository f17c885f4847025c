"""RedisQuotas on a real Redis: the in-process Quotas' decisions (all-or-none over every bucket,
the longest wait, tpm_never, reconcile), one limit across instances (= gateway replicas), atomic
under concurrent admits, idle buckets expiring. Redis' clock runs for real here, so waits are
compared approximately."""

import math
import threading
import time
import uuid

import pytest
import redis

from cloud_tier.gateway.tenants.quotas import Limits, QuotaDecision
from cloud_tier.gateway.tenants.quotas_redis import RedisQuotas

NONE = Limits()
OK = QuotaDecision(True)


@pytest.fixture
def prefix():
    return f"test:{uuid.uuid4().hex[:8]}:"  # this test's own keys in the session's Redis


@pytest.fixture
def quotas(redis_url, prefix):
    opened = []

    def make(**kwargs):
        opened.append(RedisQuotas(redis_url, prefix=prefix, **kwargs))
        return opened[-1]

    yield make
    for q in opened:
        q.close()


def refused(decision, reason, scope, retry_after):
    assert (decision.allowed, decision.reason, decision.scope) == (False, reason, scope)
    assert decision.retry_after_s == pytest.approx(retry_after, abs=0.1)


def test_a_tenant_rps_limit_holds_across_two_replicas(quotas):
    a, b = quotas(), quotas()
    assert a.admit("acme", "k1", Limits(rps=1), NONE, 10) == OK
    refused(b.admit("acme", "k2", Limits(rps=1), NONE, 10), "rps", "tenant", 1.0)
    assert b.admit("globex", "k3", Limits(rps=1), NONE, 10) == OK  # another tenant has its own bucket


def test_burst_is_the_rps_then_refusal_says_when(quotas):
    q = quotas()
    assert [q.admit("acme", "k1", Limits(rps=2), NONE, 0).allowed for _ in range(2)] == [True, True]
    refused(q.admit("acme", "k1", Limits(rps=2), NONE, 0), "rps", "tenant", 0.5)


def test_a_refusal_by_the_key_takes_nothing_from_the_tenant(quotas):
    q = quotas()
    tenant, key = Limits(rps=3), Limits(rps=1)
    assert q.admit("acme", "k1", tenant, key, 0) == OK
    refused(q.admit("acme", "k1", tenant, key, 0), "rps", "key", 1.0)
    # the tenant still has 2 of its 3: the refused request took none
    assert [q.admit("acme", "k2", tenant, NONE, 0).allowed for _ in range(3)] == [True, True, False]


def test_more_tokens_than_the_whole_minute_is_tpm_never(quotas):
    d = quotas().admit("acme", "k1", Limits(tpm=100), NONE, 101)
    assert (d.allowed, d.reason, d.scope) == (False, "tpm_never", "tenant") and math.isinf(d.retry_after_s)


def test_the_longest_wait_among_the_refusing_buckets_is_returned(quotas):
    q = quotas()
    tenant, key = Limits(tpm=60), Limits(rps=1)  # the tenant refills 1 token/s
    assert q.admit("acme", "k1", tenant, key, 60) == OK
    refused(q.admit("acme", "k1", tenant, key, 30), "tpm", "tenant", 30.0)  # not the key's 1 s


def test_reconcile_refunds_the_unused_prediction(quotas):
    q = quotas()
    tenant = Limits(tpm=600)  # 10 tokens/s
    assert q.admit("acme", "k1", tenant, NONE, 500) == OK
    refused(q.admit("acme", "k1", tenant, NONE, 500), "tpm", "tenant", 40.0)
    q.reconcile("acme", "k1", 500, 100)
    assert q.admit("acme", "k1", tenant, NONE, 500) == OK


def test_reconcile_charges_what_the_prediction_missed_into_debt(quotas):
    q = quotas()
    key = Limits(tpm=600)
    assert q.admit("acme", "k1", NONE, key, 100) == OK
    q.reconcile("acme", "k1", 100, 700)  # 600 - 700: 100 in debt
    refused(q.admit("acme", "k1", NONE, key, 1), "tpm", "key", 10.1)


def test_new_limits_start_a_full_bucket(quotas):
    q = quotas()
    assert q.admit("acme", "k1", Limits(rps=1), NONE, 0) == OK
    assert not q.admit("acme", "k1", Limits(rps=1), NONE, 0).allowed
    assert q.admit("acme", "k1", Limits(rps=2), NONE, 0) == OK


def test_no_limits_admit_without_a_bucket(quotas, redis_url, prefix):
    q = quotas()
    assert q.admit("acme", "k1", NONE, NONE, 10**9) == OK
    q.reconcile("acme", "k1", 10, 5)  # nothing to reconcile: no bucket is created
    assert redis.Redis.from_url(redis_url).keys(f"{prefix}*") == []


def test_concurrent_admits_on_two_replicas_take_exactly_the_limit(quotas):
    replicas = [quotas(), quotas()]
    tenant = Limits(tpm=60)  # 60 tokens, refilled at 1/s
    allowed = []
    start = time.monotonic()

    def admit_many(q):
        for _ in range(50):
            allowed.append(q.admit("acme", "k1", tenant, NONE, 1).allowed)

    threads = [threading.Thread(target=admit_many, args=(replicas[i % 2],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refill = time.monotonic() - start  # tokens refilled while the test ran
    assert len(allowed) == 200
    assert 60 <= sum(allowed) <= 60 + math.ceil(refill)


def test_idle_buckets_expire_once_refilled(quotas, redis_url, prefix):
    q = quotas(idle_s=0.5)
    assert q.admit("acme", "k1", Limits(rps=10), NONE, 0) == OK  # refilled after 0.1 s
    r = redis.Redis.from_url(redis_url)
    (bucket,) = r.keys(f"{prefix}*")
    assert 0 < r.pttl(bucket) <= 600
    time.sleep(0.8)
    assert r.exists(bucket) == 0
    assert q.admit("acme", "k1", Limits(rps=10), NONE, 0) == OK  # a missing bucket is a full one
