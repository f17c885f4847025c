import asyncio
import multiprocessing

import pytest

from sync.idempotency import Claim, ClaimState, IdempotencyStore
from sync.idempotency_pg import PgIdempotencyStore
from tests.pg_redis import fresh_database
from tests.unit.sync.fakes import FakeClock


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request, tmp_path):
    """``backend(**kwargs)`` opens a store (closed after the test) on one database per test: a
    SQLite file, or a fresh database on the session's PostgreSQL. Every test that uses it runs on
    both."""
    if request.param == "sqlite":
        cls, where = IdempotencyStore, tmp_path / "idem.db"
    else:
        cls, where = PgIdempotencyStore, fresh_database(request.getfixturevalue("postgres_dsn"))
    opened = []

    def open_store(**kwargs):
        opened.append(cls(where, **kwargs))
        return opened[-1]

    open_store.cls, open_store.where = cls, where
    yield open_store
    for s in opened:
        s.close()


@pytest.fixture
def store(backend, clock):
    return backend(ttl_s=3600, clock=clock, lease_s=60)


def test_first_claim_is_new_then_replays_the_stored_result(store):
    claim = store.claim("acme", "k1", "h1")
    assert claim == Claim(ClaimState.NEW) and claim.owner
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.IN_PROGRESS)
    result = {"id": "chatcmpl-1", "choices": [{"text": "hi"}], "usage": {"total_tokens": 3}}
    assert store.complete("acme", "k1", result, owner=claim.owner) is True
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.DONE, result)
    assert store.claim("acme", "k1", "h1").state == "done"  # StrEnum: compares to strings
    assert store.stats() == {"in_progress": 0, "done": 1, "released": 0}


def test_same_key_for_another_request_is_a_mismatch(store):
    acme_k1 = store.claim("acme", "k1", "h1").owner
    assert store.claim("acme", "k1", "h2") == Claim(ClaimState.MISMATCH)
    store.complete("acme", "k1", [1, 2], owner=acme_k1)
    assert store.claim("acme", "k1", "h2") == Claim(ClaimState.MISMATCH)


def test_keys_are_scoped_per_tenant(store):
    a_k1 = store.claim("a", "k1", "h1")
    assert a_k1.state == ClaimState.NEW
    assert store.claim("b", "k1", "h2").state == ClaimState.NEW
    store.complete("a", "k1", "from a", owner=a_k1.owner)
    assert store.claim("a", "k1", "h1") == Claim(ClaimState.DONE, "from a")
    assert store.claim("b", "k1", "h2") == Claim(ClaimState.IN_PROGRESS)


def test_released_key_is_claimable_again(store):
    acme_k1 = store.claim("acme", "k1", "h1").owner
    store.release("acme", "k1", owner=acme_k1)
    assert store.stats()["released"] == 1
    second = store.claim("acme", "k1", "h2")
    assert second == Claim(ClaimState.NEW) and second.owner != acme_k1  # any request may take it
    store.complete("acme", "k1", "second", owner=second.owner)
    assert store.claim("acme", "k1", "h2") == Claim(ClaimState.DONE, "second")


def test_release_and_complete_do_not_touch_a_finished_key(store):
    acme_k1 = store.claim("acme", "k1", "h1").owner
    store.complete("acme", "k1", "first", owner=acme_k1)
    store.release("acme", "k1", owner=acme_k1)
    store.complete("acme", "k1", "second", owner=acme_k1)
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.DONE, "first")


def test_unserialisable_result_raises_and_stores_nothing(store):
    acme_k1 = store.claim("acme", "k1", "h1").owner
    with pytest.raises(TypeError):
        store.complete("acme", "k1", object(), owner=acme_k1)
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.IN_PROGRESS)


def test_concurrent_duplicate_waits_for_the_first_result(store):
    async def first():
        claim = store.claim("acme", "k1", "h1")
        assert claim.state == ClaimState.NEW
        await asyncio.sleep(0.05)  # the request runs
        store.complete("acme", "k1", {"answer": 42}, owner=claim.owner)
        return "ran"

    async def duplicate():
        await asyncio.sleep(0.01)
        claim = store.claim("acme", "k1", "h1")
        assert claim.state == ClaimState.IN_PROGRESS
        return await store.wait("acme", "k1", timeout_s=5, poll_s=0.005)

    async def both():
        return await asyncio.gather(first(), duplicate())

    ran, waited = asyncio.run(both())
    assert ran == "ran"
    assert waited == Claim(ClaimState.DONE, {"answer": 42})


def test_waiter_takes_over_a_released_key(store):
    async def scenario():
        acme_k1 = store.claim("acme", "k1", "h1").owner
        waiter = asyncio.create_task(store.wait("acme", "k1", timeout_s=5, poll_s=0.005))
        await asyncio.sleep(0.02)
        store.release("acme", "k1", owner=acme_k1)
        return await waiter

    assert asyncio.run(scenario()) == Claim(ClaimState.NEW)
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.IN_PROGRESS)  # the waiter owns it


def test_wait_times_out_in_progress(store):
    store.claim("acme", "k1", "h1")
    claim = asyncio.run(store.wait("acme", "k1", timeout_s=0.03, poll_s=0.01))
    assert claim == Claim(ClaimState.IN_PROGRESS)


def test_wait_with_another_request_hash_reports_mismatch(store):
    acme_k1 = store.claim("acme", "k1", "h1").owner
    store.complete("acme", "k1", "x", owner=acme_k1)
    claim = asyncio.run(store.wait("acme", "k1", timeout_s=1, request_hash="h2"))
    assert claim == Claim(ClaimState.MISMATCH)


def test_wait_for_an_unknown_key_without_a_hash_raises(store):
    with pytest.raises(LookupError):
        asyncio.run(store.wait("acme", "nope", timeout_s=0.01))


def test_abandoned_claim_is_free_after_the_lease(store, clock):
    store.claim("acme", "k1", "h1")  # the gateway crashes here
    clock.t += 59
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.IN_PROGRESS)
    clock.t += 1
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.NEW)
    clock.t += 30  # the new claim has a lease of its own
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.IN_PROGRESS)


def test_a_done_key_is_kept_past_the_lease(store, clock):
    acme_k1 = store.claim("acme", "k1", "h1").owner
    store.complete("acme", "k1", "r", owner=acme_k1)
    clock.t += 3599
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.DONE, "r")


def test_expired_keys_are_collected(store, clock):
    acme_old = store.claim("acme", "old", "h1").owner
    store.complete("acme", "old", "r", owner=acme_old)
    acme_released = store.claim("acme", "released", "h1").owner
    store.release("acme", "released", owner=acme_released)
    store.claim("acme", "abandoned", "h1")
    clock.t += 1800
    acme_young = store.claim("acme", "young", "h1").owner
    store.complete("acme", "young", "y", owner=acme_young)
    clock.t += 1800
    assert store.collect_expired() == 3
    assert store.stats() == {"in_progress": 0, "done": 1, "released": 0}
    assert store.claim("acme", "old", "h2") == Claim(ClaimState.NEW)
    assert store.claim("acme", "young", "h1") == Claim(ClaimState.DONE, "y")
    assert store.collect_expired() == 0
    clock.t += 1800
    assert store.collect_expired() == 1  # young; old's second claim is 1800 s old


def test_expired_but_uncollected_key_claims_new(store, clock):
    acme_k1 = store.claim("acme", "k1", "h1").owner
    store.complete("acme", "k1", "r", owner=acme_k1)
    clock.t += 3600
    assert store.claim("acme", "k1", "h2") == Claim(ClaimState.NEW)


def test_two_stores_share_one_database(backend, clock):
    a, b = backend(clock=clock), backend(clock=clock)
    claim = a.claim("acme", "k1", "h1")
    assert claim.state == ClaimState.NEW
    assert b.claim("acme", "k1", "h1").state == ClaimState.IN_PROGRESS
    a.complete("acme", "k1", {"ok": True}, owner=claim.owner)
    assert b.claim("acme", "k1", "h1") == Claim(ClaimState.DONE, {"ok": True})


def _claim_all(cls, where, n, results):
    store = cls(where)
    results.put([store.claim("acme", f"k{i}", "h").state.value for i in range(n)])
    store.close()


def test_processes_racing_on_a_fresh_database_each_key_is_new_once(backend):
    # also covers several processes creating the schema at once
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_claim_all, args=(backend.cls, backend.where, 50, results))
             for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    states = [results.get(timeout=5) for _ in procs]
    assert all(sorted(s[i] for s in states) == ["in_progress"] * 3 + ["new"] for i in range(50))


@pytest.mark.parametrize("key", ["", "x" * 256])
def test_key_length_is_bounded(store, key):
    with pytest.raises(ValueError):
        store.claim("acme", key, "h1")


def test_lease_must_fit_in_the_ttl(backend):
    with pytest.raises(ValueError):
        backend(ttl_s=10, lease_s=60)


# --- owners and leases ------------------------------------------------------------------------

def test_a_first_flight_past_its_lease_cannot_complete_or_release_the_seconds_claim(store, clock):
    first = store.claim("acme", "k1", "h1").owner
    clock.t += 60  # the first flight runs past its lease (and is not renewed): a duplicate runs
    second = store.claim("acme", "k1", "h1")
    assert second.state == ClaimState.NEW and second.owner != first
    assert store.release("acme", "k1", owner=first) is False  # the first ends: the second's claim stays
    assert store.complete("acme", "k1", "from the first", owner=first) is False
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.IN_PROGRESS)
    assert store.complete("acme", "k1", "from the second", owner=second.owner) is True
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.DONE, "from the second")


def test_a_renewed_claim_outlives_its_lease(store, clock):
    owner = store.claim("acme", "k1", "h1").owner
    for _ in range(5):  # 250 s of running, renewed every 50 s: never free
        clock.t += 50
        assert store.renew("acme", "k1", owner=owner) is True
        assert store.claim("acme", "k1", "h1") == Claim(ClaimState.IN_PROGRESS)
    assert store.renew("acme", "k1", owner="someone else") is False
    clock.t += 60
    assert store.claim("acme", "k1", "h1").state == ClaimState.NEW  # not renewed for a lease: free
    assert store.renew("acme", "k1", owner=owner) is False  # and the old owner has lost it


def test_a_finished_claim_is_not_renewed(store):
    owner = store.claim("acme", "k1", "h1").owner
    store.complete("acme", "k1", "r", owner=owner)
    assert store.renew("acme", "k1", owner=owner) is False


def test_heartbeat_keeps_a_running_claim_past_a_short_lease(backend):
    store = backend(lease_s=0.3)

    async def scenario():
        owner = store.claim("acme", "k1", "h1").owner
        beat = asyncio.create_task(store.heartbeat("acme", "k1", owner))
        await asyncio.sleep(1.0)  # more than three leases
        held = store.claim("acme", "k1", "h1")
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
        await asyncio.sleep(0.4)  # no heartbeat: free after a lease
        return held, store.claim("acme", "k1", "h1")

    held, after = asyncio.run(scenario())
    assert held == Claim(ClaimState.IN_PROGRESS)
    assert after.state == ClaimState.NEW


def test_heartbeat_ends_when_the_claim_is_no_longer_held(backend):
    store = backend(lease_s=0.3)

    async def scenario():
        owner = store.claim("acme", "k1", "h1").owner
        beat = asyncio.create_task(store.heartbeat("acme", "k1", owner))
        store.complete("acme", "k1", "r", owner=owner)
        return await asyncio.wait_for(beat, 2.0)

    assert asyncio.run(scenario()) is None


def test_a_store_from_before_owners_is_migrated(tmp_path, clock):
    import sqlite3

    path = tmp_path / "idem.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE idempotency (tenant TEXT, key TEXT, request_hash TEXT NOT NULL, "
                     "state TEXT NOT NULL, "
                     "result TEXT, created_at FLOAT NOT NULL, updated_at FLOAT NOT NULL, PRIMARY KEY (tenant, key))")
        conn.execute("INSERT INTO idempotency VALUES ('acme', 'k1', 'h1', 'done', '\"r\"', ?, ?)", (clock.t, clock.t))
    store = IdempotencyStore(path, clock=clock)
    try:
        assert store.claim("acme", "k1", "h1") == Claim(ClaimState.DONE, "r")
        owner = store.claim("acme", "k2", "h1").owner
        assert store.complete("acme", "k2", "r2", owner=owner) is True
    finally:
        store.close()
