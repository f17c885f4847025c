"""The gateway's Prometheus metrics (its own registry): per tenant (unless ``tenant_labels`` is
off, for a scraper that should not learn who the tenants are) and per worker."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cloud_tier.gateway.foreign.routing import pressure, queue_of

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)


class GatewayMetrics:
    def __init__(self, tenant_labels: bool = True):
        r = self.registry = CollectorRegistry()
        self.tenant_labels = tenant_labels
        t = ["tenant"] if tenant_labels else []
        self.requests = Counter("cascade_gateway_requests_total",
                                "Requests by tenant, endpoint and outcome (ok, cache_hit, replay, 4xx, "
                                "429_<reason>, 5xx: failed by the cloud, 499: the client left)",
                                [*t, "endpoint", "outcome"], registry=r)
        self.class_requests = Counter("cascade_gateway_class_requests_total",
                                      "Requests by priority class (interactive, escalation, batch) and outcome",
                                      ["priority_class", "outcome"], registry=r)
        self.tokens_in = Counter("cascade_gateway_prompt_tokens_total", "Prompt tokens", t, registry=r)
        self.tokens_out = Counter("cascade_gateway_completion_tokens_total", "Generated tokens", t, registry=r)
        self.drafts = Counter("cascade_gateway_drafts_total", "Requests whose device draft (cascade.draft) a worker "
                              "verified", registry=r)
        self.draft_tokens = Counter("cascade_gateway_draft_tokens_total", "Draft tokens by outcome: offered "
                                    "(verified by a worker), accepted (kept: not generated again)", ["outcome"],
                                    registry=r)
        self.goodput = Counter("cascade_gateway_goodput_requests_total",
                               "Requests that met both the TTFT and the TPOT objectives", t, registry=r)
        self.ttft = Histogram("cascade_gateway_time_to_first_token_seconds", "Arrival to first token",
                              t, buckets=_LATENCY, registry=r)
        self.tpot = Histogram("cascade_gateway_time_per_output_token_seconds", "Mean time between tokens",
                              t, buckets=_TPOT, registry=r)
        self.worker_usage_refused = Counter(
            "cascade_gateway_worker_usage_refused_total",
            "A worker's usage numbers not taken as they came: not_integer or negative (refused: the gateway's own "
            "count charged), over_bound (clamped to what the request could use)", ["reason"], registry=r)
        self.worker_load_refused = Counter(
            "cascade_gateway_worker_load_refused_total",
            "Polls of a worker's load refused for what it said (too_large, not_json, bad_report, not_prometheus, "
            "not_number, non_finite, negative, out_of_range): the poll counts as failed", ["reason"], registry=r)
        self._load_refused_seen: dict[str, int] = {}
        self.cache = Counter("cascade_gateway_result_cache_total", "Result cache lookups", ["result"], registry=r)
        self._cache_hit, self._cache_miss = self.cache.labels("hit"), self.cache.labels("miss")
        # (metric, label values) -> its child: labels() takes a lock and builds the key every call, on
        # every request; a child lives as long as its metric anyway
        self._children: dict[tuple, object] = {}
        self.worker_kv_total = Gauge("cascade_gateway_worker_kv_blocks_total", "KV blocks", ["worker", "role"],
                                     registry=r)
        self.worker_kv_used = Gauge("cascade_gateway_worker_kv_blocks_used", "KV blocks in use or committed",
                                    ["worker", "role"], registry=r)
        self.worker_committed = Gauge("cascade_gateway_worker_committed_blocks",
                                      "KV blocks the gateway has committed to its requests in flight there",
                                      ["worker", "role"], registry=r)
        self.worker_queue = Gauge("cascade_gateway_worker_queue", "Requests waiting or in flight",
                                  ["worker", "role"], registry=r)
        self.worker_prefix_hit = Gauge("cascade_gateway_worker_prefix_hit_rate",
                                       "Share of prompt tokens the worker found in its prefix cache",
                                       ["worker", "role"], registry=r)
        self.worker_healthy = Gauge("cascade_gateway_worker_healthy", "1 when the health check passes",
                                    ["worker", "role"], registry=r)
        self.worker_breaker_open = Gauge("cascade_gateway_worker_breaker_open",
                                         "1 while the worker's circuit breaker keeps requests away", ["worker", "role"],
                                         registry=r)
        self.worker_pressure = Gauge("cascade_gateway_worker_pressure",
                                     "A foreign worker's load against its saturation point (1: saturated; +Inf: its "
                                     "numbers are stale)", ["worker", "role"], registry=r)
        self.admission_waiting = Gauge("cascade_gateway_admission_waiting", "Requests waiting for KV room",
                                       registry=r)

    def of(self, metric, tenant: str, *labels: str):
        """``metric`` for ``tenant`` and ``labels`` (the tenant left out when tenant labels are off)."""
        values = (tenant, *labels) if self.tenant_labels else labels
        child = self._children.get((metric, values))
        if child is None:
            child = self._children[metric, values] = metric.labels(*values) if values else metric
        return child

    def of_class(self, priority_class: str, outcome: str):
        """The class counter's child (cached like ``of``'s: class and outcome are few)."""
        child = self._children.get((self.class_requests, priority_class, outcome))
        if child is None:
            child = self._children[self.class_requests, priority_class, outcome] = self.class_requests.labels(
                priority_class, outcome)
        return child

    def cache_lookup(self, hit: bool) -> None:
        (self._cache_hit if hit else self._cache_miss).inc()

    def refresh(self, pool, admission, routing=None) -> None:
        now = time.monotonic()
        for w in pool.workers.values():
            labels = (w.url, w.role)
            load = w.load()
            if w.is_foreign and w.foreign is not None:
                total = w.foreign.kv_tokens // 16
                self.worker_kv_total.labels(*labels).set(total)
                self.worker_kv_used.labels(*labels).set(round(w.foreign.kv_usage * total))
                self.worker_queue.labels(*labels).set(queue_of(w))
            else:
                self.worker_kv_total.labels(*labels).set(load.kv_blocks_total)
                self.worker_kv_used.labels(*labels).set(load.kv_blocks_used)
                self.worker_queue.labels(*labels).set(load.queue_len)
            self.worker_breaker_open.labels(*labels).set(0 if w.breaker is None or w.breaker.available else 1)
            if routing is not None and pool.foreign:
                self.worker_pressure.labels(*labels).set(pressure(w, routing, now))
            self.worker_committed.labels(*labels).set(w.committed_blocks)
            self.worker_healthy.labels(*labels).set(1 if w.healthy else 0)
            r = w.report
            if r is not None and r.prefix_cache_queries:
                self.worker_prefix_hit.labels(*labels).set(r.prefix_cache_hits / r.prefix_cache_queries)
        for reason, n in getattr(pool, "load_refused", {}).items():
            if n > self._load_refused_seen.get(reason, 0):
                self.worker_load_refused.labels(reason).inc(n - self._load_refused_seen.get(reason, 0))
                self._load_refused_seen[reason] = n
        self.admission_waiting.set(admission.waiting)
