"""Spend caps: budgets per tenant and per key, in tokens and USD, per UTC day or month, with spend
counted in the key store's database (SQLite, PostgreSQL) or in Redis; an injected clock moves
across period boundaries."""

import calendar
import logging
import uuid

import pytest

from cascade import errors
from cascade.processes import free_port
from cloud_tier.gateway.tenants.budgets import Budgets, RedisSpend, period_of
from cloud_tier.gateway.tenants.keys import Budget
from cloud_tier.gateway.tenants.keys_pg import PgKeyStore
from cloud_tier.gateway.tenants.keys_sqlite import KeyStore
from tests.pg_redis import fresh_database

JAN_31_2359 = calendar.timegm((2026, 1, 31, 23, 59, 0))
PRICES = {"smollm2-135m": (1.0, 2.0), "*": (10.0, 10.0)}  # USD per million prompt, completion tokens


class FakeClock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(params=["sqlite", "postgres", "redis"])
def replica(request, tmp_path):
    """``replica(clock) -> Budgets``: one gateway's budgets; every replica of a test shares the key
    store and the spend counters (spend in the key store's SQLite or PostgreSQL database, or in Redis)."""
    where = fresh_database(request.getfixturevalue("postgres_dsn")) if request.param == "postgres" else \
        tmp_path / "gateway.db"
    redis_prefix = f"test:{uuid.uuid4().hex[:8]}:"
    opened = []

    def make(clock, prices=PRICES) -> Budgets:
        keys = PgKeyStore(where) if request.param == "postgres" else KeyStore(where)
        spend = RedisSpend(request.getfixturevalue("redis_url"), redis_prefix) if request.param == "redis" else keys
        opened.extend({keys, spend})
        return Budgets(keys, spend, prices, clock)

    yield make
    for part in opened:
        part.close()


def refusal(budgets, key) -> errors.APIError:
    with pytest.raises(errors.APIError) as e:
        budgets.check(key)
    return e.value


def test_over_the_token_budget_is_429_budget_exceeded_until_the_reset(replica):
    b = replica(FakeClock(JAN_31_2359))
    _, key = b.keys.create("acme")
    b.keys.set_budget("key", key.key_id, tokens=100, period="day")
    b.charge(key, "smollm2-135m", 40, 50)
    b.check(key)  # 90 of 100: still served
    b.charge(key, "smollm2-135m", 10, 5)  # the request in flight overshoots: 105
    e = refusal(b, key)
    assert (e.status, e.type, e.code) == (429, "rate_limit_error", "budget_exceeded")
    assert e.headers["Retry-After"] == "60"  # to midnight UTC
    assert f"key '{key.key_id}'" in e.message and "2026-02-01T00:00:00Z" in e.message
    assert "daily budget of 100 tokens" in e.message


def test_the_budget_resets_at_the_period_boundary(replica):
    clock = FakeClock(JAN_31_2359)
    b = replica(clock)
    _, key = b.keys.create("acme")
    b.keys.set_budget("key", key.key_id, tokens=100, period="day")
    b.keys.set_budget("tenant", "acme", tokens=1000, period="month")
    b.charge(key, "smollm2-135m", 100, 0)
    assert refusal(b, key).code == "budget_exceeded"
    clock.t += 59.999
    assert refusal(b, key).headers["Retry-After"] == "1"
    clock.t += 0.001  # 2026-02-01T00:00:00Z: a new day and a new month
    b.check(key)
    tenant, own = b.status("acme", key.key_id)
    assert (tenant.period_id, tenant.tokens, own.period_id, own.tokens) == ("2026-02", 0, "2026-02-01", 0)


def test_a_monthly_budget_counts_the_whole_month(replica):
    clock = FakeClock(calendar.timegm((2026, 12, 1, 0, 0, 0)))
    b = replica(clock)
    _, key = b.keys.create("acme")
    b.keys.set_budget("tenant", "acme", tokens=100)  # monthly by default
    b.charge(key, "smollm2-135m", 60, 0)
    clock.t += 30 * 86400 + 3600  # 2026-12-31T01:00
    b.charge(key, "smollm2-135m", 40, 0)
    e = refusal(b, key)
    assert "tenant 'acme'" in e.message and "2027-01-01T00:00:00Z" in e.message
    assert e.headers["Retry-After"] == str(23 * 3600)


def test_a_tenant_budget_is_shared_by_its_keys_across_replicas(replica):
    clock = FakeClock(JAN_31_2359)
    a, b = replica(clock), replica(clock)
    _, k1 = a.keys.create("acme")
    _, k2 = a.keys.create("acme")
    _, other = a.keys.create("globex")
    a.keys.set_budget("tenant", "acme", tokens=100)
    a.charge(k1, "smollm2-135m", 70, 30)  # spent on replica a ...
    assert refusal(b, k2).message.startswith("The tenant 'acme'")  # ... refused on replica b
    b.check(other)


def test_a_usd_budget_is_priced_per_model(replica):
    b = replica(FakeClock(JAN_31_2359))
    _, key = b.keys.create("acme")
    b.keys.set_budget("key", key.key_id, usd=0.0005)
    b.charge(key, "smollm2-135m", 100, 50)  # (100 x 1 + 50 x 2) / 1e6 = $0.0002
    b.check(key)
    assert b.status("acme", key.key_id)[1].usd == pytest.approx(0.0002)
    b.charge(key, "another-model", 20, 10)  # "*": $10 per million both ways = $0.0003
    assert b.status("acme", key.key_id)[1].usd == pytest.approx(0.0005)
    assert "$0.0005" in refusal(b, key).message


def test_an_unpriced_model_costs_no_usd_but_its_tokens_count(replica):
    b = replica(FakeClock(JAN_31_2359), prices={})
    _, key = b.keys.create("acme")
    b.keys.set_budget("key", key.key_id, tokens=10, usd=0.01)
    b.charge(key, "smollm2-135m", 6, 6)
    spend = b.status("acme", key.key_id)[1]
    assert (spend.tokens, spend.usd) == (12, 0)
    assert refusal(b, key).code == "budget_exceeded"


def test_a_charge_of_no_tokens_counts_nothing(replica):
    b = replica(FakeClock(JAN_31_2359))
    _, key = b.keys.create("acme")
    b.charge(key, "smollm2-135m", 0, 0)  # a cache hit
    assert [(s.tokens, s.usd) for s in b.status("acme", key.key_id)] == [(0, 0), (0, 0)]


def test_spend_is_counted_without_a_budget_and_shown(replica):
    b = replica(FakeClock(JAN_31_2359))
    _, key = b.keys.create("acme")
    b.charge(key, "smollm2-135m", 3, 4)
    tenant, own = b.status("acme", key.key_id)
    assert (tenant.budget, tenant.tokens, own.tokens, own.period_id) == (Budget(), 7, 7, "2026-01")
    assert b.status("acme", key.key_id, active_only=True) == []
    b.check(key)


def test_without_budgets_check_reads_no_spend_and_a_lost_charge_is_logged(tmp_path, caplog):
    keys = KeyStore(tmp_path / "gateway.db")
    dead = RedisSpend(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    b = Budgets(keys, dead, PRICES, FakeClock(JAN_31_2359))
    _, key = keys.create("acme")
    b.check(key)  # no budget: nothing to read
    with caplog.at_level(logging.ERROR):
        b.charge(key, "smollm2-135m", 5, 5)  # the answer was served: not raised
    assert "not counted" in caplog.text
    keys.close()
    dead.close()


@pytest.mark.parametrize("t, period, expected", [
    ((2026, 1, 31, 23, 59, 59), "day", ("2026-01-31", (2026, 2, 1))),
    ((2026, 2, 1, 0, 0, 0), "day", ("2026-02-01", (2026, 2, 2))),
    ((2026, 2, 28, 12, 0, 0), "month", ("2026-02", (2026, 3, 1))),
    ((2026, 12, 31, 23, 0, 0), "month", ("2026-12", (2027, 1, 1))),
    ((2028, 2, 29, 1, 0, 0), "day", ("2028-02-29", (2028, 3, 1))),
])
def test_periods_are_utc_calendar_days_and_months(t, period, expected):
    period_id, resets = period_of(period, calendar.timegm(t))
    assert (period_id, resets) == (expected[0], calendar.timegm((*expected[1], 0, 0, 0)))


@pytest.mark.parametrize("kwargs, message", [
    ({"tokens": -1}, "budget tokens"), ({"usd": float("nan")}, "budget usd"), ({"period": "week"}, "period"),
])
def test_bad_budgets_are_refused_and_nothing_is_written(tmp_path, kwargs, message):
    keys = KeyStore(tmp_path / "gateway.db")
    with pytest.raises(ValueError, match=message):
        keys.set_budget("tenant", "acme", **kwargs)
    with pytest.raises(ValueError, match="scope"):
        keys.set_budget("team", "acme", tokens=1)
    with pytest.raises(ValueError, match="key id"):
        keys.set_budget("key", "NOT-A-KEY", tokens=1)
    assert keys.budget("tenant", "acme") == Budget()
    keys.close()
