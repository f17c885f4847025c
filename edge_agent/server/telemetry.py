"""The device's telemetry: every ``telemetry_interval_s`` one record (request counts, escalation
reasons, latencies, queue backlog, model version) is spooled into the offline queue, from which
sync/mqtt.py publishes it to ``cascade/v1/{fleet}/devices/{device}/telemetry`` when connected.
Counters are cumulative since the agent started (a consumer takes differences), so a record that
is dropped or arrives twice loses or doubles nothing."""

from __future__ import annotations

import asyncio
import logging
import platform
import time

from prometheus_client import CollectorRegistry

import cascade
from edge_agent.server.outbox import Outbox
from edge_agent.server.service import EdgeService

log = logging.getLogger(__name__)


def _samples(registry: CollectorRegistry) -> dict[str, list]:
    out: dict[str, list] = {}
    for metric in registry.collect():
        for s in metric.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _by(samples: list, *labels: str) -> dict[str, float]:
    return {"/".join(lab[k] for k in labels): v for lab, v in samples if v}


def _latency(samples: dict, name: str) -> dict:
    """Count, mean and the cumulative histogram buckets {upper bound: count} (so a consumer can
    take a percentile over any window: the difference of two records' buckets)."""
    count = sum(v for _, v in samples.get(f"{name}_count", []))
    total = sum(v for _, v in samples.get(f"{name}_sum", []))
    buckets: dict[str, float] = {}
    for labels, v in samples.get(f"{name}_bucket", []):
        buckets[labels["le"]] = buckets.get(labels["le"], 0) + v
    return {"count": int(count), "mean_s": round(total / count, 4) if count else None,
            "buckets": {k: int(v) for k, v in buckets.items()}}


def snapshot(service: EdgeService, outbox: Outbox, device: str, fleet: str, started: float) -> dict:
    s = _samples(service.metrics.registry)
    q = outbox.queue.stats()
    d = service.description
    return {
        "kind": "telemetry", "device": device, "fleet": fleet, "ts": round(time.time(), 3),
        "uptime_s": round(time.time() - started, 1),
        "requests": _by(s.get("cascade_edge_requests_total", []), "endpoint", "status"),
        "decisions": _by(s.get("cascade_edge_decisions_total", []), "tier", "reason"),
        "rejected": _by(s.get("cascade_edge_rejected_total", []), "reason"),
        "latency": {"ttft": _latency(s, "cascade_edge_time_to_first_token_seconds"),
                    "e2e": _latency(s, "cascade_edge_request_duration_seconds")},
        # decode speed: the tokens after each first one and the time between them (tokens/s = the ratio)
        "decode": {"tokens": int(sum(v for _, v in s.get("cascade_edge_inter_token_latency_seconds_count", []))),
                   "seconds": round(sum(v for _, v in s.get("cascade_edge_inter_token_latency_seconds_sum", [])), 4)},
        "tokens": {"prompt": int(sum(v for _, v in s.get("cascade_edge_prompt_tokens_total", []))),
                   "generated": int(sum(v for _, v in s.get("cascade_edge_generation_tokens_total", [])))},
        "queue": {"pending": q["pending_items"], "pending_bytes": q["pending_bytes"],
                  "oldest_pending_age_s": q["oldest_pending_age_s"], "telemetry_dropped": q["telemetry_dropped"],
                  "requests": q["by_kind"]["request"]},
        "model": {"name": d.name, "quantization": d.quantization, "architecture": d.architecture,
                  "n_ctx": d.n_ctx},
        "agent": {"version": cascade.__version__, "python": platform.python_version()},
    }


async def spool_forever(service: EdgeService, outbox: Outbox, device: str, fleet: str, interval_s: float,
                        on_spooled=None) -> None:
    """Spool one record now and then every ``interval_s`` until cancelled."""
    started = time.time()
    while True:
        try:
            record = await asyncio.to_thread(snapshot, service, outbox, device, fleet, started)
            if await outbox.spool_telemetry(record) is not None and on_spooled is not None:
                on_spooled()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("telemetry record not spooled")
        await asyncio.sleep(interval_s)
