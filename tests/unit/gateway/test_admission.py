"""KV admission at the gateway as tables (no workers, no network): a request is placed where its
peak KV fits under the watermark after what is committed there; an online request counts the
blocks committed to batch-class requests as free (our engines preempt batch for it), a batch
request never counts anyone's; a request with its own TTFT target is refused as "slo"."""

import asyncio

import httpx
import pytest

from cascade import errors
from cloud_tier.disagg.protocol import WorkerLoadReport
from cloud_tier.gateway.workers.admission import Admission
from cloud_tier.gateway.workers.pool import WorkerPool

URL = "http://w0"


def admission(total=100) -> Admission:
    pool = WorkerPool([URL], httpx.AsyncClient())
    w = pool.workers[URL]
    w.role, w.kind, w.healthy = "both", "cascade", True
    w.report = WorkerLoadReport(role="both", model="m", max_model_len=1024, block_size=16, kv_blocks_total=total,
                                kv_blocks_free=total, waiting=0, running=0, prefix_cache_queries=0,
                                prefix_cache_hits=0)
    return Admission(pool, high_watermark=0.9)


def admit(a: Admission, need: int, batch: bool = False, reason: str = "kv_capacity"):
    return asyncio.run(a.admit(need, 0.05, ("decode", "both"), reason=reason, batch=batch))


def test_an_online_request_counts_the_blocks_committed_to_batch_as_free():
    a = admission()
    batch = admit(a, 50, batch=True)
    assert batch.batch and a.pool.workers[URL].batch_blocks == 50
    online = admit(a, 80)  # 50 + 80 > 90, but the 50 are batch's: the engine preempts it
    assert not online.batch and a.pool.workers[URL].committed_blocks == 130
    a.release(batch)
    a.release(online)
    w = a.pool.workers[URL]
    assert (w.committed_blocks, w.batch_blocks, w.in_flight) == (0, 0, 0)


def test_a_batch_request_counts_every_commitment_and_online_ones_each_others():
    a = admission()
    online = admit(a, 60)
    with pytest.raises(errors.APIError) as e:
        admit(a, 40, batch=True)
    assert e.value.status == 429 and e.value.code == "kv_capacity"
    with pytest.raises(errors.APIError):
        admit(a, 40)  # online over online: no one gives way
    a.release(online)
    assert admit(a, 40, batch=True).batch


def test_a_request_with_its_own_ttft_target_is_refused_as_slo():
    a = admission()
    admit(a, 80)
    with pytest.raises(errors.APIError) as e:
        admit(a, 40, reason="slo")
    assert e.value.status == 429 and e.value.code == "slo" and int(e.value.headers["Retry-After"]) >= 1
