"""A worker's load numbers before they reach placement, admission, a gauge or a timer (issue 37, the
class "numbers from a worker used unchecked"): our workers' /internal/load and vLLM's /metrics,
answered by a fake worker (httpx.MockTransport: it injects the faults) with NaN, infinities,
negatives, 1e999, 2**70, wrong types and a giant body. Each is refused (counted by reason, the
worker's last good numbers kept) or clamped; the poll loop never dies; the next honest numbers are
used; placement never picks a worker by a number it should not have believed."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from cloud_tier.gateway.foreign.routing import ForeignRouting, choose, pressure, queue_of
from cloud_tier.gateway.pipeline.metrics import GatewayMetrics
from cloud_tier.gateway.workers.load import MAX_SCRAPE_BYTES
from cloud_tier.gateway.workers.placement import PrefixIndex
from cloud_tier.gateway.workers.pool import WorkerPool

SCRAPE = (Path(__file__).parent / "data" / "vllm_metrics.txt").read_text()  # 2 running, 6 waiting


def vllm_text(waiting="0", running="0", usage="0.5", blocks="100", block_size="16") -> str:
    return (f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
            f'vllm:num_requests_running{{model_name="m"}} {running}\n'
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {usage}\n'
            f'vllm:cache_config_info{{block_size="{block_size}",num_gpu_blocks="{blocks}"}} 1.0\n')


class FakeWorker:
    """Answers each URL path with the next of its queued bodies (the last one repeats); a body may be
    an async generator, whose chunks are counted as they are pulled."""

    def __init__(self, answers: dict[str, list]):
        self.answers = answers
        self.pulled = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        queue = self.answers.get(request.url.path)
        if not queue:
            return httpx.Response(404)
        body = queue.pop(0) if len(queue) > 1 else queue[0]
        if callable(body):
            return httpx.Response(200, content=body())
        return httpx.Response(200, content=body.encode() if isinstance(body, str) else body)

    def giant(self, total: int = 64 << 20, chunk: int = 64 << 10):
        async def body():
            for _ in range(total // chunk):
                self.pulled += chunk
                yield b"#" * (chunk - 1) + b"\n"
        return body


def pool_of(fake: FakeWorker, urls=("http://w0",), kind="vllm") -> WorkerPool:
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake.handle))
    return WorkerPool(list(urls), client, kind=kind, metrics_interval_s=0.01, interval_s=0.01)


def sane(w) -> None:
    f = w.foreign
    for v in (f.waiting, f.running, f.kv_usage, f.kv_tokens, f.block_size):
        assert isinstance(v, int | float) and math.isfinite(v) and v >= 0
    assert 0 <= f.kv_usage <= 1 and f.waiting <= 1 << 20 and f.kv_tokens <= 1 << 40 and f.block_size >= 1
    assert math.isfinite(pressure(w, ForeignRouting(), time.monotonic())) and math.isfinite(queue_of(w))


HOSTILE_METRICS = [
    ("NaN waiting", vllm_text(waiting="NaN"), "non_finite"),
    ("+Inf running", vllm_text(running="+Inf"), "non_finite"),
    ("1e999 usage", vllm_text(usage="1e999"), "non_finite"),
    ("negative waiting", vllm_text(waiting="-1e9"), "negative"),
    ("NaN usage", vllm_text(usage="NaN"), "non_finite"),
    ("1e999 blocks (a label)", vllm_text(blocks="1e999"), "non_finite"),
    ("negative block size", vllm_text(block_size="-16"), "negative"),
    ("not a number (a label)", vllm_text(blocks="many"), "not_number"),
    ("not Prometheus' text", "vllm:num_requests_waiting{{{ 3\n", "not_prometheus"),
]


@pytest.mark.parametrize(("name", "text", "reason"), HOSTILE_METRICS, ids=[h[0] for h in HOSTILE_METRICS])
def test_a_hostile_vllm_scrape_is_refused_counted_and_the_last_good_numbers_kept(name, text, reason):
    fake = FakeWorker({"/health": ["ok"], "/metrics": [SCRAPE, text, text, SCRAPE]})
    pool = pool_of(fake)
    w = pool.workers["http://w0"]

    async def run():
        await pool.poll()
        assert w.healthy and (w.foreign.waiting, w.foreign.running) == (6, 2)
        good_at = w.scraped_at
        await pool.poll()  # refused once: still up (a loaded host may answer oddly once), numbers kept
        assert pool.load_refused[reason] == 1 and w.healthy and w.scraped_at == good_at
        sane(w)
        assert (w.foreign.waiting, w.foreign.running) == (6, 2)
        await pool.poll()  # twice in a row: down, as any failed poll
        assert pool.load_refused[reason] == 2 and not w.healthy
        await pool.poll()  # honest again: up, with those numbers
        assert w.healthy and w.scraped_at > good_at and (w.foreign.waiting, w.foreign.running) == (6, 2)
        metrics = GatewayMetrics()
        metrics.refresh(pool, SimpleNamespace(waiting=0), ForeignRouting())
        assert metrics.registry.get_sample_value("cascade_gateway_worker_load_refused_total",
                                                 {"reason": reason}) == 2

    asyncio.run(run())


def test_numbers_past_any_real_worker_are_clamped_and_gauges_stay_finite():
    fake = FakeWorker({"/health": ["ok"], "/metrics": [vllm_text(waiting=str(2**70), running="1e300", usage="250",
                                                                 blocks=str(2**70), block_size=str(2**70))]})
    pool = pool_of(fake)
    w = pool.workers["http://w0"]
    asyncio.run(pool.poll())
    assert w.healthy
    sane(w)
    assert w.foreign.waiting == 1 << 20 and w.foreign.kv_usage == 1.0
    metrics = GatewayMetrics()
    metrics.refresh(pool, SimpleNamespace(waiting=0), ForeignRouting())  # no OverflowError from round()


def test_a_giant_scrape_is_refused_while_read_and_the_poll_loop_keeps_going():
    fake = FakeWorker({"/health": ["ok"]})
    fake.answers["/metrics"] = [vllm_text(waiting="7"), fake.giant(), vllm_text(waiting="NaN"),
                                vllm_text(waiting="3")]
    pool = pool_of(fake)
    w = pool.workers["http://w0"]

    async def run():
        await pool.start()
        assert w.foreign.waiting == 7
        deadline = time.monotonic() + 10
        while w.foreign.waiting != 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not pool._task.done()  # the loop lives on
        await pool.close()

    asyncio.run(run())
    assert w.foreign.waiting == 3 and w.healthy
    assert pool.load_refused["too_large"] == 1 and pool.load_refused["non_finite"] == 1
    assert fake.pulled <= MAX_SCRAPE_BYTES + (1 << 20)  # not the 64 MiB the worker would have sent


def test_placement_never_picks_by_a_number_it_refused():
    fake = FakeWorker({"/health": ["ok"]})
    pool = pool_of(fake, urls=("http://a", "http://b"))
    answers = {"http://a": [vllm_text(waiting="1", usage="0.1")],
               "http://b": [vllm_text(waiting="7", usage="0.8"), vllm_text(waiting="-1e9", usage="0.0")]}

    async def handle(request):
        if request.url.path == "/metrics":
            queue = answers[f"http://{request.url.host}"]
            return httpx.Response(200, content=(queue.pop(0) if len(queue) > 1 else queue[0]).encode())
        return httpx.Response(200, content=b"ok")

    pool.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    pool.decide_mode()

    async def run():
        await pool.poll()
        await pool.poll()  # b now claims -1e9 waiting and an empty cache

    asyncio.run(run())
    cfg = ForeignRouting(max_waiting=8)
    for w in pool.workers.values():
        sane(w)
    ticket, _ = choose(list(pool.workers.values()), PrefixIndex(), [], 0, cfg, 1)
    assert ticket.worker.url == "http://a"


def report(**over) -> str:
    body = {"role": "both", "model": "m", "max_model_len": 1024, "block_size": 16, "kv_blocks_total": 100,
            "kv_blocks_free": 60, "waiting": 2, "running": 1, "prefix_cache_queries": 10, "prefix_cache_hits": 5}
    body.update(over)
    return json.dumps(body)


HOSTILE_REPORTS = [
    ("negative free blocks", report(kv_blocks_free=-5), "negative"),
    ("zero block size", report(block_size=0), "out_of_range"),
    ("a string for a number", report(waiting="5"), "bad_report"),
    ("a float for a number", report(waiting=2.5), "bad_report"),
    ("a bool for a number", report(waiting=True), "bad_report"),
    ("2**70 waiting", report(waiting=2**70), "not_json"),
    ("NaN", report().replace('"waiting": 2', '"waiting": NaN'), "not_json"),
]


@pytest.mark.parametrize(("name", "body", "reason"), HOSTILE_REPORTS, ids=[h[0] for h in HOSTILE_REPORTS])
def test_a_hostile_load_report_of_our_worker_is_refused(name, body, reason):
    fake = FakeWorker({"/internal/load": [report(), body, report(waiting=4)]})
    pool = pool_of(fake, kind="cascade")
    w = pool.workers["http://w0"]

    async def run():
        await pool.poll()
        assert w.healthy and w.report.waiting == 2
        await pool.poll()
        assert pool.load_refused[reason] == 1 and w.healthy and w.report.waiting == 2
        assert pool.block_size == 16 and w.load().kv_blocks_total == 100
        await pool.poll()
        assert w.report.waiting == 4

    asyncio.run(run())


def test_a_load_report_past_any_real_worker_is_clamped():
    fake = FakeWorker({"/internal/load": [report(kv_blocks_free=500, prefix_cache_hits=99, waiting=2**62,
                                                 kv_blocks_total=2**62, max_model_len=2**62)]})
    pool = pool_of(fake, kind="cascade")
    w = pool.workers["http://w0"]
    asyncio.run(pool.poll())
    r = w.report
    assert w.healthy and r.kv_blocks_free <= r.kv_blocks_total <= 1 << 32
    assert r.prefix_cache_hits <= r.prefix_cache_queries and r.waiting <= 1 << 20 and r.max_model_len <= 1 << 24


def test_a_giant_load_report_is_refused_while_read():
    fake = FakeWorker({})
    fake.answers["/internal/load"] = [report(), fake.giant(), report(waiting=4)]
    pool = pool_of(fake, kind="cascade")

    async def run():
        for _ in range(3):
            await pool.poll()

    asyncio.run(run())
    assert pool.load_refused["too_large"] == 1 and pool.workers["http://w0"].report.waiting == 4
    assert fake.pulled <= MAX_SCRAPE_BYTES + (1 << 20)


def test_a_discovery_answer_with_hostile_ports_and_addresses_routes_nowhere_odd():
    from cloud_tier.gateway.workers.discovery import pods_to_workers

    def pod(name, ip, port):
        return {"metadata": {"name": name, "namespace": "n"},
                "spec": {"containers": [{"ports": [{"name": "http", "containerPort": port}]}]},
                "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}

    found = pods_to_workers({"items": [pod("a", "10.0.0.1", 2**70), pod("b", "10.0.0.2", -1), pod("c", "10.0.0.3", "x"),
                                       pod("d", "10.0.0.4/evil?", 8000), pod("e", "fd00::1", 9000)]}, port=8000)
    assert [d.url for d in found] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000",
                                      "http://[fd00::1]:9000"]
