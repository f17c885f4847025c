"""Prometheus metrics of one edge agent (its own registry: two agents can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1)


class EdgeMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        # every /v1 answer, once (status_count.CountAnswers): endpoint chat | completions | models |
        # requests | other; status the HTTP one, or for a stream that started 200 how it ended (499, 5xx)
        self.requests = Counter("cascade_edge_requests_total", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.rejected = Counter("cascade_edge_rejected_total", "Requests refused before generation, by reason",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("cascade_edge_prompt_tokens_total", "Prompt tokens processed", registry=r)
        self.cached_prompt_tokens = Counter("cascade_edge_cached_prompt_tokens_total",
                                            "Prompt tokens reused from the slot's KV cache", registry=r)
        self.generation_tokens = Counter("cascade_edge_generation_tokens_total", "Tokens generated", registry=r)
        self.decisions = Counter("cascade_edge_decisions_total", "Who answered (edge, cloud, reject) and why",
                                 ["tier", "reason"], registry=r)
        self.hold_back = Histogram("cascade_edge_hold_back_seconds",
                                   "Time spent holding back the first K tokens to judge confidence",
                                   buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10), registry=r)
        self.queue_waiting = Gauge("cascade_edge_queue_waiting", "Requests waiting for a slot", registry=r)
        self.slots_busy = Gauge("cascade_edge_slots_busy", "Slots generating now", registry=r)
        self.slots_total = Gauge("cascade_edge_slots_total", "Slots (parallel generations)", registry=r)
        self.ttft = Histogram("cascade_edge_time_to_first_token_seconds",
                              "Arrival to first generated token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("cascade_edge_inter_token_latency_seconds",
                             "Time between consecutive generated tokens", buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("cascade_edge_request_duration_seconds",
                             "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r)

    def observe_queue(self, pool) -> None:
        self.queue_waiting.set(pool.waiting)
        self.slots_busy.set(pool.busy)
        self.slots_total.set(pool.size)
