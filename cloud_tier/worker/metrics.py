"""Prometheus metrics of one worker (its own registry), engine gauges refreshed at scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)


class WorkerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("cascade_worker_requests_total", "Requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("cascade_worker_prompt_tokens_total", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("cascade_worker_generation_tokens_total", "Generated tokens", registry=r)
        self.ttft = Histogram("cascade_worker_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("cascade_worker_inter_token_latency_seconds", "Between tokens", buckets=_TOKEN,
                             registry=r)
        self.e2e = Histogram("cascade_worker_request_duration_seconds", "Arrival to last token",
                             buckets=_LATENCY, registry=r)
        by_tenant = ["tenant", "priority_class"]
        self.finished = Counter("cascade_worker_slo_requests_total", "Finished requests by tenant and class",
                                by_tenant, registry=r)
        self.goodput = Counter("cascade_worker_goodput_requests_total", "Finished requests that met both their "
                               "TTFT and TPOT targets (goodput: its rate)", by_tenant, registry=r)
        self.slo_rejected = Counter("cascade_worker_slo_rejected_total", "Requests refused (429, reason slo): "
                                    "they would have missed their TTFT target", by_tenant, registry=r)
        self.kv_blocks_total = Gauge("cascade_worker_kv_blocks_total", "KV cache blocks", registry=r)
        self.kv_blocks_used = Gauge("cascade_worker_kv_blocks_used", "KV cache blocks in use or cached-free "
                                    "excluded", registry=r)
        self.waiting = Gauge("cascade_worker_requests_waiting", "Requests waiting", registry=r)
        self.running = Gauge("cascade_worker_requests_running", "Requests running", registry=r)
        self.preemptions = Gauge("cascade_worker_preemptions", "Preemptions so far", registry=r)
        self.prefix_queries = Gauge("cascade_worker_prefix_cache_queries_tokens", "Prompt tokens looked up",
                                    registry=r)
        self.prefix_hits = Gauge("cascade_worker_prefix_cache_hits_tokens", "Prompt tokens found cached",
                                 registry=r)
        # speculative decoding: devices' drafts (per request), the engine's own n-gram proposals (engine totals)
        self.drafts = Counter("cascade_worker_drafts_total", "Drafts received: outcome received (this "
                              "tokenizer), tokenizer_mismatch (run without), verified, refused (run without)",
                              ["outcome"], registry=r)
        self.draft_offered = Counter("cascade_worker_draft_tokens_offered_total", "Draft tokens received (verified "
                                     "drafts)", registry=r)
        self.draft_accepted = Counter("cascade_worker_draft_tokens_accepted_total", "Draft tokens accepted",
                                      registry=r)
        self.draft_acceptance = Histogram("cascade_worker_draft_acceptance_rate", "Accepted / offered per draft",
                                          buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 1), registry=r)
        self.ngram_proposed = Gauge("cascade_worker_ngram_tokens_proposed", "n-gram tokens proposed so far",
                                    registry=r)
        self.ngram_accepted = Gauge("cascade_worker_ngram_tokens_accepted", "n-gram tokens accepted so far",
                                    registry=r)

        # guided decoding (a grammar on the output): requests received here, grammars compiled and refused
        self.guided = Counter("cascade_worker_guided_requests_total", "Requests whose output follows a grammar "
                              "(response_format, tools)", registry=r)
        self.grammar_compiles = Gauge("cascade_worker_grammar_compiles", "Grammars compiled so far (a cache "
                                      "miss)", registry=r)
        self.grammar_refused = Gauge("cascade_worker_grammar_refused", "Grammars refused so far (could not be "
                                     "compiled within bounds)", registry=r)

    def refresh(self, stats: dict) -> None:
        self.kv_blocks_total.set(stats["kv_blocks_total"])
        self.kv_blocks_used.set(stats["kv_blocks_total"] - stats["kv_blocks_free"])
        self.waiting.set(stats["waiting"])
        self.running.set(stats["running"])
        self.preemptions.set(stats["preemptions"])
        self.prefix_queries.set(stats["prefix_cache_queries"])
        self.prefix_hits.set(stats["prefix_cache_hits"])
        self.ngram_proposed.set(stats.get("spec_ngram_tokens_proposed", 0))
        self.ngram_accepted.set(stats.get("spec_ngram_tokens_accepted", 0))
        self.grammar_compiles.set(stats.get("grammar_compiles", 0))
        self.grammar_refused.set(stats.get("guided_refused", 0))

    def observe_draft(self, out) -> dict:
        """Count a finished request's draft (an engine ``RequestOutput``); its report for the answer."""
        if out.draft_skipped:
            self.drafts.labels(outcome="refused").inc()
            return {"offered": out.draft_offered, "accepted": 0, "skipped": out.draft_skipped}
        self.drafts.labels(outcome="verified").inc()
        self.draft_offered.inc(out.draft_offered)
        self.draft_accepted.inc(out.draft_accepted)
        if out.draft_offered:
            self.draft_acceptance.observe(out.draft_accepted / out.draft_offered)
        return {"offered": out.draft_offered, "accepted": out.draft_accepted}
