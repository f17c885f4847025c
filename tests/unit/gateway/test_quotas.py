"""Gateway quotas: token buckets per tenant and per key, all-or-nothing admission, fake clock."""

import math

import pytest

from cloud_tier.gateway.tenants.quotas import Limits, QuotaDecision, Quotas, TokenBucket

NONE = Limits()


class FakeClock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def refused(retry_after, reason, scope):
    return QuotaDecision(False, retry_after, reason, scope)


OK = QuotaDecision(True)


# --- TokenBucket ------------------------------------------------------------------------------

@pytest.mark.parametrize("steps,expected_level", [
    pytest.param([("take", 3, 0.0)], 7.0, id="take-from-full"),
    pytest.param([("take", 10, 0.0), ("take", 1, 0.5)], 0.0, id="empty-says-when"),
    pytest.param([("take", 8, 0.0), ("take", 5, 1.5)], 2.0, id="refusal-takes-nothing"),
    pytest.param([("take", 11, math.inf)], 10.0, id="more-than-capacity-never"),
    pytest.param([("take", 10, 0.0), ("wait", 2.5), ("take", 5, 0.0)], 0.0, id="refills-over-time"),
    pytest.param([("wait", 100)], 10.0, id="refill-capped-at-capacity"),
    pytest.param([("take", 4, 0.0), ("give_back", 9)], 10.0, id="refund-capped-at-capacity"),
    pytest.param([("charge", 14), ("take", 1, 2.5)], -4.0, id="charge-goes-into-debt"),
    pytest.param([("take", 7, 0.0), ("wait", 0.1), ("take", 3.2, 0.0)], 0.0,
                 id="waiting-the-returned-time-is-enough"),
])
def test_token_bucket(steps, expected_level):
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, capacity=10.0, clock=clock)
    for op, *args in steps:
        if op == "take":
            amount, wait = args
            assert bucket.try_take(amount) == pytest.approx(wait)
        elif op == "wait":
            clock.advance(args[0])
        else:
            getattr(bucket, op)(args[0])
    assert bucket.level == pytest.approx(expected_level, abs=1e-9)


def test_waiting_exactly_the_returned_time_lets_the_take_through():
    clock = FakeClock()
    bucket = TokenBucket(rate=0.1, capacity=1.0, clock=clock)
    assert bucket.try_take(0.7) == 0.0
    wait = bucket.try_take(1.0)
    clock.advance(wait)
    assert bucket.try_take(1.0) == 0.0


@pytest.mark.parametrize("rate,capacity", [(0, 1), (1, 0), (-1, 5)])
def test_token_bucket_rejects_non_positive_parameters(rate, capacity):
    with pytest.raises(ValueError):
        TokenBucket(rate, capacity)


# --- Quotas -----------------------------------------------------------------------------------

def test_burst_over_rps_is_refused_with_the_time_to_the_next_token():
    clock = FakeClock()
    q = Quotas(clock)
    t = Limits(rps=2)
    assert [q.admit("t", "k", t, NONE, 0) for _ in range(2)] == [OK, OK]
    assert q.admit("t", "k", t, NONE, 0) == refused(0.5, "rps", "tenant")
    clock.advance(0.5)
    assert q.admit("t", "k", t, NONE, 0) == OK


def test_fractional_rps_still_allows_a_burst_of_one():
    clock = FakeClock()
    q = Quotas(clock)
    k = Limits(rps=0.5)
    assert q.admit("t", "k", NONE, k, 0) == OK
    assert q.admit("t", "k", NONE, k, 0) == refused(2.0, "rps", "key")


def test_tpm_is_charged_at_admission_and_refunded_on_reconcile():
    clock = FakeClock()
    q = Quotas(clock)
    t = Limits(tpm=600)  # refills 10 tokens/s
    assert q.admit("t", "k", t, NONE, 500) == OK
    assert q.admit("t", "k", t, NONE, 200) == refused(10.0, "tpm", "tenant")
    q.reconcile("t", "k", predicted_tokens=500, actual_tokens=100)
    assert q.admit("t", "k", t, NONE, 200) == OK


def test_reconcile_charges_when_actual_exceeds_predicted():
    clock = FakeClock()
    q = Quotas(clock)
    k = Limits(tpm=600)
    assert q.admit("t", "k", NONE, k, 600) == OK
    q.reconcile("t", "k", predicted_tokens=600, actual_tokens=660)
    decision = q.admit("t", "k", NONE, k, 1)
    assert (decision.allowed, decision.reason, decision.scope) == (False, "tpm", "key")
    assert decision.retry_after_s == pytest.approx(6.1)


def test_reconcile_without_tpm_buckets_is_a_no_op():
    q = Quotas(FakeClock())
    q.reconcile("t", "k", 100, 5)
    assert q.admit("t", "k", NONE, NONE, 10**9) == OK


def test_tenant_bucket_is_shared_by_its_keys():
    q = Quotas(FakeClock())
    t = Limits(rps=2)
    assert q.admit("t", "k1", t, NONE, 0) == OK
    assert q.admit("t", "k1", t, NONE, 0) == OK
    assert q.admit("t", "k2", t, NONE, 0) == refused(0.5, "rps", "tenant")


def test_key_buckets_are_separate():
    q = Quotas(FakeClock())
    k = Limits(rps=1)
    assert q.admit("t", "k1", NONE, k, 0) == OK
    assert q.admit("t", "k1", NONE, k, 0) == refused(1.0, "rps", "key")
    assert q.admit("t", "k2", NONE, k, 0) == OK


def test_refusal_takes_from_no_bucket():
    q = Quotas(FakeClock())
    t, k = Limits(rps=2), Limits(tpm=100)
    assert q.admit("t", "k", t, k, 80) == OK
    assert q.admit("t", "k", t, k, 50) == refused(18.0, "tpm", "key")
    assert q.admit("t", "k", t, k, 10) == OK  # the tenant's second request token was not taken


def test_retry_after_is_the_longest_wait_among_refusing_buckets():
    q = Quotas(FakeClock())
    t, k = Limits(rps=1), Limits(tpm=60)
    assert q.admit("t", "k", t, k, 60) == OK
    assert q.admit("t", "k", t, k, 30) == refused(30.0, "tpm", "key")


def test_request_larger_than_the_minute_budget_can_never_pass():
    q = Quotas(FakeClock())
    t, k = Limits(rps=5, tpm=1000), Limits(tpm=100)
    assert q.admit("t", "k", t, k, 101) == refused(math.inf, "tpm_never", "key")
    assert q.admit("t", "k", t, k, 100) == OK


def test_tenants_are_isolated():
    q = Quotas(FakeClock())
    t = Limits(rps=1, tpm=100)
    assert q.admit("t1", "k", t, NONE, 100) == OK
    assert not q.admit("t1", "k", t, NONE, 1).allowed
    assert q.admit("t2", "k", t, NONE, 100) == OK


def test_changed_limits_recreate_the_bucket():
    q = Quotas(FakeClock())
    assert q.admit("t", "k", Limits(rps=1), NONE, 0) == OK
    assert not q.admit("t", "k", Limits(rps=1), NONE, 0).allowed
    assert q.admit("t", "k", Limits(rps=3), NONE, 0) == OK


def test_zero_limits_never_refuse():
    q = Quotas(FakeClock())
    assert all(q.admit("t", "k", NONE, NONE, 10**6) == OK for _ in range(1000))


@pytest.mark.parametrize("kwargs", [{"rps": -1}, {"tpm": -0.5}])
def test_limits_reject_negative_values(kwargs):
    with pytest.raises(ValueError):
        Limits(**kwargs)
