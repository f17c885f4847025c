"""The fair-share pass of KV admission between tenants, as tables (no workers, no network, a fake
clock): the room an active tenant wanted (up to an equal share of the pool) is kept from the
others, a tenant holding more than its share waits behind another's waiting requests, a tenant
holding nothing may always start one request, an idle tenant's room lapses after the window, and
batch-class requests are outside the pass."""

import asyncio

import httpx
import pytest

from cascade import errors
from cloud_tier.config import GatewayConfig
from cloud_tier.disagg.protocol import WorkerLoadReport
from cloud_tier.gateway.tenants.tenant_share import TenantShares
from cloud_tier.gateway.workers.admission import Admission
from cloud_tier.gateway.workers.pool import WorkerPool

URL = "http://w0"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def admission(total=100, window_s=10.0, clock=None) -> Admission:
    """One worker of ``total`` blocks (90 under the watermark), fair shares on."""
    pool = WorkerPool([URL], httpx.AsyncClient())
    w = pool.workers[URL]
    w.role, w.kind, w.healthy = "both", "cascade", True
    w.report = WorkerLoadReport(role="both", model="m", max_model_len=1024, block_size=16, kv_blocks_total=total,
                                kv_blocks_free=total, waiting=0, running=0, prefix_cache_queries=0,
                                prefix_cache_hits=0)
    return Admission(pool, high_watermark=0.9, shares=TenantShares(window_s, clock or Clock()))


def admit(a: Admission, tenant: str, need: int, batch: bool = False, wait_s: float = 0.05):
    return asyncio.run(a.admit(need, wait_s, ("decode", "both"), batch=batch, tenant=tenant))


def refused(a: Admission, tenant: str, need: int, batch: bool = False) -> bool:
    try:
        admit(a, tenant, need, batch)
    except errors.APIError as e:
        assert e.status == 429 and e.code == "kv_capacity"
        return True
    return False


@pytest.mark.parametrize("wanted, held, expected", [
    ((12,), (0,), 12),  # B wanted 12, holds none: 12 kept for it
    ((80,), (0,), 45),  # ... up to an equal share of two tenants (90 / 2)
    ((80,), (30,), 15),  # ... less what it holds
    ((80,), (60,), 0),  # over its share: nothing more kept
    ((12, 80), (0, 0), 12 + 30),  # three tenants: each up to 90 / 3
])
def test_the_room_kept_for_others_is_what_each_wanted_up_to_an_equal_share(wanted, held, expected):
    shares = TenantShares(10.0, Clock())
    shares.took("a", 1)
    for i, (w, h) in enumerate(zip(wanted, held, strict=True)):
        shares.wait(f"t{i}", w)
        shares.unwait(f"t{i}", w)
        shares.took(f"t{i}", h)
    assert shares.kept_for_others("a", 90) == expected


def test_a_flood_leaves_the_room_a_tenant_active_within_the_window_wanted():
    clock = Clock()
    a = admission(clock=clock)
    b_tickets = [admit(a, "b", 3) for _ in range(4)]  # B alone wanted 12
    for t in b_tickets:
        a.release(t)
    clock.now += 5  # B comes back within the window
    flood = [admit(a, "a", 10) for _ in range(7)]  # A may take 90 - 12 = 78 of 90: 7 x 10
    assert refused(a, "a", 10)
    assert [admit(a, "b", 3).tenant for _ in range(4)] == ["b"] * 4  # B's 12 start at once
    assert a.shares.held("a") == 70 and a.shares.held("b") == 12
    for t in flood:
        a.release(t)


def test_an_idle_tenants_room_lapses_after_the_window():
    clock = Clock()
    a = admission(clock=clock)
    a.release(admit(a, "b", 40))
    clock.now += 11
    assert len([admit(a, "a", 10) for _ in range(9)]) == 9  # the whole pool: B is no longer active


def test_a_tenant_over_its_share_waits_behind_anothers_waiting_request():
    a = admission()
    flood = [admit(a, "a", 30) for _ in range(3)]  # A came first and took all 90

    async def race():
        a2 = asyncio.create_task(a.admit(20, 0.3, ("decode", "both"), tenant="a"))  # A's waits first
        b = asyncio.create_task(a.admit(20, 2.0, ("decode", "both"), tenant="b"))
        await asyncio.sleep(0.05)  # both wait
        a.release(flood[0])  # 30 free: B's 20 may go, A's would take what B waits for
        ticket = await b
        with pytest.raises(errors.APIError):
            await a2  # 10 left, and B (under its share of 45) wants more than it holds
        return ticket

    assert asyncio.run(race()).tenant == "b"


def test_a_tenant_holding_nothing_may_start_one_request_larger_than_a_share():
    a = admission()
    a.release(admit(a, "b", 5))  # B active: A's share is 45
    big = admit(a, "a", 60)  # over its share, but it holds nothing
    assert big.blocks == 60 and refused(a, "a", 26)  # then B's 5 stay free: 90 - 60 - 26 < 5
    a.release(admit(a, "a", 25))
    a.release(big)


def test_batch_requests_are_outside_the_pass():
    a = admission()
    a.release(admit(a, "b", 40))  # B wanted 40: 40 kept from A's online requests
    online = admit(a, "a", 10)
    assert refused(a, "a", 45)  # online: 90 - 10 - 45 < 40
    batch = admit(a, "a", 45, batch=True)  # batch: under the watermark is enough
    assert batch.batch and a.shares.held("a") == 10
    a.release(batch)
    a.release(online)
    assert a.shares.held("a") == 0


def test_fair_shares_off_is_first_come_first_served():
    pool = WorkerPool([URL], httpx.AsyncClient())
    config = GatewayConfig(workers=URL, tenant_kv_fair=False)
    assert Admission.of(pool, config).shares is None
    assert Admission.of(pool, GatewayConfig(workers=URL)).shares.window_s == 10.0
