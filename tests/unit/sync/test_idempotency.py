import asyncio
import multiprocessing

import pytest

from sync.idempotency import Claim, ClaimState, IdempotencyStore
from tests.unit.sync.fakes import FakeClock


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def store(tmp_path, clock):
    s = IdempotencyStore(tmp_path / "idem.db", ttl_s=3600, clock=clock, lease_s=60)
    yield s
    s.close()


def test_first_claim_is_new_then_replays_the_stored_result(store):
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.NEW)
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.IN_PROGRESS)
    result = {"id": "chatcmpl-1", "choices": [{"text": "hi"}], "usage": {"total_tokens": 3}}
    store.complete("acme", "k1", result)
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.DONE, result)
    assert store.claim("acme", "k1", "h1").state == "done"  # StrEnum: compares to strings
    assert store.stats() == {"in_progress": 0, "done": 1, "released": 0}


def test_same_key_for_another_request_is_a_mismatch(store):
    store.claim("acme", "k1", "h1")
    assert store.claim("acme", "k1", "h2") == Claim(ClaimState.MISMATCH)
    store.complete("acme", "k1", [1, 2])
    assert store.claim("acme", "k1", "h2") == Claim(ClaimState.MISMATCH)


def test_keys_are_scoped_per_tenant(store):
    assert store.claim("a", "k1", "h1").state == ClaimState.NEW
    assert store.claim("b", "k1", "h2").state == ClaimState.NEW
    store.complete("a", "k1", "from a")
    assert store.claim("a", "k1", "h1") == Claim(ClaimState.DONE, "from a")
    assert store.claim("b", "k1", "h2") == Claim(ClaimState.IN_PROGRESS)


def test_released_key_is_claimable_again(store):
    store.claim("acme", "k1", "h1")
    store.release("acme", "k1")
    assert store.stats()["released"] == 1
    assert store.claim("acme", "k1", "h2") == Claim(ClaimState.NEW)  # any request may take it
    store.complete("acme", "k1", "second")
    assert store.claim("acme", "k1", "h2") == Claim(ClaimState.DONE, "second")


def test_release_and_complete_do_not_touch_a_finished_key(store):
    store.claim("acme", "k1", "h1")
    store.complete("acme", "k1", "first")
    store.release("acme", "k1")
    store.complete("acme", "k1", "second")
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.DONE, "first")


def test_unserialisable_result_raises_and_stores_nothing(store):
    store.claim("acme", "k1", "h1")
    with pytest.raises(TypeError):
        store.complete("acme", "k1", object())
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.IN_PROGRESS)


def test_concurrent_duplicate_waits_for_the_first_result(store):
    async def first():
        assert store.claim("acme", "k1", "h1").state == ClaimState.NEW
        await asyncio.sleep(0.05)  # the request runs
        store.complete("acme", "k1", {"answer": 42})
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
        store.claim("acme", "k1", "h1")
        waiter = asyncio.create_task(store.wait("acme", "k1", timeout_s=5, poll_s=0.005))
        await asyncio.sleep(0.02)
        store.release("acme", "k1")
        return await waiter

    assert asyncio.run(scenario()) == Claim(ClaimState.NEW)
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.IN_PROGRESS)  # the waiter owns it


def test_wait_times_out_in_progress(store):
    store.claim("acme", "k1", "h1")
    claim = asyncio.run(store.wait("acme", "k1", timeout_s=0.03, poll_s=0.01))
    assert claim == Claim(ClaimState.IN_PROGRESS)


def test_wait_with_another_request_hash_reports_mismatch(store):
    store.claim("acme", "k1", "h1")
    store.complete("acme", "k1", "x")
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
    store.claim("acme", "k1", "h1")
    store.complete("acme", "k1", "r")
    clock.t += 3599
    assert store.claim("acme", "k1", "h1") == Claim(ClaimState.DONE, "r")


def test_expired_keys_are_collected(store, clock):
    store.claim("acme", "old", "h1")
    store.complete("acme", "old", "r")
    store.claim("acme", "released", "h1")
    store.release("acme", "released")
    store.claim("acme", "abandoned", "h1")
    clock.t += 1800
    store.claim("acme", "young", "h1")
    store.complete("acme", "young", "y")
    clock.t += 1800
    assert store.collect_expired() == 3
    assert store.stats() == {"in_progress": 0, "done": 1, "released": 0}
    assert store.claim("acme", "old", "h2") == Claim(ClaimState.NEW)
    assert store.claim("acme", "young", "h1") == Claim(ClaimState.DONE, "y")
    assert store.collect_expired() == 0
    clock.t += 1800
    assert store.collect_expired() == 1  # young; old's second claim is 1800 s old


def test_expired_but_uncollected_key_claims_new(store, clock):
    store.claim("acme", "k1", "h1")
    store.complete("acme", "k1", "r")
    clock.t += 3600
    assert store.claim("acme", "k1", "h2") == Claim(ClaimState.NEW)


def test_two_stores_share_one_file(tmp_path, clock):
    a = IdempotencyStore(tmp_path / "idem.db", clock=clock)
    b = IdempotencyStore(tmp_path / "idem.db", clock=clock)
    try:
        assert a.claim("acme", "k1", "h1").state == ClaimState.NEW
        assert b.claim("acme", "k1", "h1").state == ClaimState.IN_PROGRESS
        a.complete("acme", "k1", {"ok": True})
        assert b.claim("acme", "k1", "h1") == Claim(ClaimState.DONE, {"ok": True})
    finally:
        a.close()
        b.close()


def _claim_all(path, n, results):
    store = IdempotencyStore(path)
    results.put([store.claim("acme", f"k{i}", "h").state.value for i in range(n)])
    store.close()


def test_processes_racing_on_a_fresh_file_each_key_is_new_once(tmp_path):
    # also covers several processes creating the schema at once
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_claim_all, args=(tmp_path / "idem.db", 50, results))
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


def test_lease_must_fit_in_the_ttl(tmp_path):
    with pytest.raises(ValueError):
        IdempotencyStore(tmp_path / "idem.db", ttl_s=10, lease_s=60)
