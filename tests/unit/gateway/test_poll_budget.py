"""Polling the workers costs a bounded share of a core whatever their number (issue 42): the
pool's GETs a second stay under ``max_polls_per_s`` (polls spread further apart beyond it) and a
worker's numbers go stale only after three of its polls; an idle batch runner does not look at
its store five times a second."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from cloud_tier.config import GatewayConfig
from cloud_tier.gateway.batch.runner import BatchRunner, RunnerConfig
from cloud_tier.gateway.batch.store import BatchStore
from cloud_tier.gateway.workers.pool import WorkerPool


@pytest.mark.parametrize("workers, kind, expected", [(1, "vllm", 1.0), (10, "vllm", 1.0), (100, "vllm", 10.0),
                                                    (1000, "sglang", 100.0), (1000, "openai", 50.0)])
def test_the_polls_a_second_stay_under_the_budget(workers, kind, expected):
    pool = WorkerPool([f"http://w{i}" for i in range(workers)], httpx.AsyncClient(), kind=kind, metrics_interval_s=1.0,
                      max_polls_per_s=20.0)
    pool.decide_mode()
    every = pool.poll_interval()
    assert every == pytest.approx(expected)
    gets = workers * (2 if kind in ("vllm", "sglang") else 1)
    assert gets / every <= 20.0 + 1e-9


def test_a_worker_polled_rarely_goes_stale_after_three_polls_not_before():
    pool = WorkerPool([f"http://w{i}" for i in range(200)], httpx.AsyncClient(), kind="vllm", max_polls_per_s=20.0)
    w = pool.workers["http://w0"]
    w.poll_every_s = pool.poll_interval()  # 20 s
    now = time.monotonic()
    w.scraped_at = now - 50.0
    assert not w.stale(now, stale_after_s=3.0)
    w.scraped_at = now - 61.0
    assert w.stale(now, stale_after_s=3.0)


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), 1e9])
def test_a_poll_budget_out_of_range_is_refused(value):
    with pytest.raises(ValueError, match="max_polls_per_s"):
        GatewayConfig(workers="http://w", max_polls_per_s=value)


def test_an_idle_batch_runner_waits_for_a_batch_instead_of_polling(tmp_path):
    store = BatchStore(tmp_path / "batches.db")
    looks = []
    real = store.open_batches

    def counted():
        looks.append(time.monotonic())
        return real()

    store.open_batches = counted

    async def run() -> None:
        runner = BatchRunner(None, store, RunnerConfig(interval_s=0.01, idle_interval_s=5.0))
        task = asyncio.create_task(runner.run())
        await asyncio.sleep(0.5)
        assert len(looks) == 1  # one look, then a wait (not 50 looks at 0.01 s)
        store.created.set()  # a batch created through the API
        await asyncio.sleep(0.2)
        assert len(looks) == 2
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
