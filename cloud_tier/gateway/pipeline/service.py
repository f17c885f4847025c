"""The gateway's request pipeline, in order: idempotency -> validation (the model's tokenizer)
-> result cache (on the prompt's token ids) -> quotas -> KV admission -> routing and the decode worker's event stream
(``pipeline.worker_client``), relayed as OpenAI SSE or JSON. Whatever happens, a request's commitments
(KV ticket, quota charge, idempotency claim) are settled exactly once when its event stream
closes (``pipeline.flight.Recorder``, ``pipeline.settlement``)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator

import httpx

from cascade import errors
from cloud_tier.config import GatewayConfig, parse_class_slos
from cloud_tier.gateway.foreign import answers
from cloud_tier.gateway.foreign.proxy import Attempt, OpenAIProxy, ProxyConfig
from cloud_tier.gateway.foreign.routing import ForeignRouting, choose
from cloud_tier.gateway.pipeline.flight import Flight, Recorder, RunToEnd, observe_chunk
from cloud_tier.gateway.pipeline.metrics import GatewayMetrics
from cloud_tier.gateway.pipeline.result_cache import ResultCache, cache_key
from cloud_tier.gateway.pipeline.settlement import Settlement, outcome_of, tokens_used  # noqa: F401 (tokens_used: re-exported)
from cloud_tier.gateway.pipeline.stores import Stores
from cloud_tier.gateway.pipeline.worker_client import WorkerClient
from cloud_tier.gateway.tenants.keys import ApiKey, check_priority
from cloud_tier.gateway.tenants.quotas import Limits
from cloud_tier.gateway.workers.admission import Admission
from cloud_tier.gateway.workers.placement import PrefixIndex, RouterConfig, text_block_hashes
from cloud_tier.gateway.workers.pool import WorkerPool
from cloud_tier.gateway.workers.usage import UsageBounds, foreign_bounds
from cloud_tier.request_builder import RequestBuilder, check_slo_floors
from sync.idempotency import ClaimState

log = logging.getLogger(__name__)

def request_hash(endpoint: str, body: dict) -> str:
    """What an Idempotency-Key is bound to: the request minus how it is delivered."""
    core = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return hashlib.sha256(json.dumps([endpoint, core], sort_keys=True, separators=(",", ":"),
                                     default=str).encode()).hexdigest()


def request_priority(key: ApiKey, requested: object) -> int:
    """The engine priority a request runs at: its key's, or a later one it asks for (the engine
    serves lower numbers first and preempts for them, so a request may only lower its own
    standing, never jump ahead of other tenants). Anything else is a 400."""
    if requested is None:
        return key.priority
    try:
        check_priority(requested)
    except ValueError as e:
        raise errors.bad_request(f"Invalid value for 'priority': {e}.", "priority", "invalid_value") from e
    if requested < key.priority:
        raise errors.bad_request(
            f"priority {requested} would run ahead of this key's priority {key.priority}; a request may only "
            f"ask for {key.priority} or more (lower numbers are served first).", "priority", "priority_not_allowed")
    return requested


class GatewayService:
    def __init__(self, config: GatewayConfig, pool: WorkerPool, stores: Stores, builder: RequestBuilder,
                 model_id: str, aliases: set[str], client: httpx.AsyncClient,
                 worker_api_key: str = ""):
        self.config = config
        self.pool = pool
        self.keys = stores.keys
        self.idempotency = stores.idempotency
        self.builder = builder
        self.model_id = model_id
        self.model_names = {model_id, *aliases}
        self.max_model_len = builder.max_model_len if builder is not None else None
        self.metrics = GatewayMetrics(config.metrics_tenant_labels)
        self.settlement = Settlement(self)
        self.quotas = stores.quotas
        self.cache = stores.cache
        # (tenant, endpoint, a body's digest) -> its result cache key: the prompt's token ids need the
        # tokenizer, by far the costliest step of a cache hit (a body's plan never changes)
        self.cache_keys = ResultCache(config.result_cache_entries, ttl_s=config.result_cache_ttl_s)
        self.budgets = stores.budgets
        self.admission = Admission.of(pool, config)
        self.router_config = RouterConfig(
            alpha=config.route_alpha, beta=config.route_beta, prefill_ms_per_token=config.prefill_ms_per_token,
            overload_percentile=config.overload_percentile, overload_min_tokens=config.overload_min_tokens,
            block_size=pool.block_size)
        self.index = PrefixIndex(pool.block_size, self.router_config.index_blocks_per_worker)
        self.workers = WorkerClient(pool, client, self.admission, self.index, self.router_config, config.kv_transport,
                                    config.ttft_slo_s, worker_api_key, parse_class_slos(config.class_slos),
                                    config.worker_max_event_bytes, config.worker_max_body_bytes)
        # foreign workers (vLLM, SGLang, any OpenAI-compatible server): no tokenizer, their own load numbers
        self.routing = ForeignRouting(
            max_waiting=config.worker_max_waiting, kv_high_watermark=config.kv_high_watermark,
            stale_after_s=config.stale_after_s, shed_step=config.shed_step, prefix_weight=config.route_prefix_weight,
            queue_weight=config.route_queue_weight, kv_weight=config.route_kv_weight)
        self.text_index = PrefixIndex(1, self.router_config.index_blocks_per_worker)
        self.proxy = OpenAIProxy(pool, client, ProxyConfig(
            retries=config.retries, retry_backoff_s=config.retry_backoff_s,
            first_token_timeout_s=config.first_token_timeout_s, answer_timeout_s=config.request_timeout_s,
            max_event_bytes=config.worker_max_event_bytes, max_body_bytes=config.worker_max_body_bytes,
            kv_connector=config.kv_connector,
            pd_min_prompt_chars=config.pd_min_prompt_chars, pd_skip_hit_share=config.pd_skip_hit_share,
            vllm_priority=config.foreign_priority),
            worker_api_key)

    # -- auth ----------------------------------------------------------------------------

    def authenticate(self, authorization: str, scope: str = "infer") -> ApiKey:
        scheme, _, token = authorization.partition(" ")
        key = self.keys.verify(token.strip()) if scheme.lower() == "bearer" else None
        if key is None:
            raise errors.unauthorized()
        if scope not in key.scopes:
            raise errors.APIError(403, f"This API key lacks the {scope!r} scope.", "permission_error",
                                  code="insufficient_scope")
        return key

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise errors.model_not_found(model)

    # -- the pipeline --------------------------------------------------------------------

    async def begin(self, key: ApiKey, endpoint: str, body: dict, req, idem_key: str | None,
                    request_id: str | None = None, priority_class: str = "interactive",
                    deadline_s: float | None = None) -> tuple[AsyncIterator | dict, dict[str, str]]:
        """The request's event stream, or the stored result of a cache hit or a replay, and the
        response headers to add. Raises APIError (with everything already settled) when it is
        not served."""
        flight = Flight(key.tenant, key, endpoint, time.perf_counter(), idem_key=idem_key,
                        priority_class=priority_class, deadline_s=deadline_s)
        try:  # what the tenant may ask of the engines, before anything is claimed
            check_slo_floors(req.model_extra or {}, *self.keys.tenant_limits(key.tenant).slo_floors(
                self.config.min_ttft_slo_s, self.config.min_tpot_slo_s))
        except errors.APIError as e:
            self.settlement.count_flight(flight, outcome_of(e))
            raise
        if idem_key:
            stored = await self._claim(flight, body)
            if stored is not None:
                self.settlement.count_flight(flight, "replay")
                return stored, {"X-Cascade-Idempotent-Replay": "true", "X-Cascade-Cache": "miss"}
        if self.pool.foreign:
            return await self._begin_foreign(flight, endpoint, body, req, request_id or uuid.uuid4().hex)
        try:
            priority = request_priority(key, (req.model_extra or {}).get("priority"))
            # a body this tenant sent before has the same plan, so the same cache key: a hit is
            # looked up without rendering and tokenizing the prompt again (the digest of the body's
            # repr: the same for the same JSON object, at a third of request_hash's cost)
            seen = (key.tenant, endpoint, hashlib.sha256(repr(body).encode()).digest())
            flight.cache_key = self.cache_keys.get(seen)
            plan = None
            if flight.cache_key is None:
                plan = self._plan(endpoint, req, priority)
                flight.cache_key = cache_key(key.tenant, self.model_id, endpoint, plan)
                if flight.cache_key:
                    self.cache_keys.put(seen, flight.cache_key, 0, owner=key.tenant)
            hit = self.cache.get(flight.cache_key) if flight.cache_key else None
            self.metrics.cache_lookup(hit is not None)
            if hit is not None:
                self._check_quota(flight, 0)
                self.settlement.end_claim(flight, hit)
                self.settlement.count_flight(flight, "cache_hit")
                return hit, {"X-Cascade-Cache": "hit"}
            if plan is None:  # seen before, but its answer is no longer cached
                plan = self._plan(endpoint, req, priority)
            self._check_quota(flight, plan.max_total_tokens)
            flight.predicted_tokens = plan.max_total_tokens
            flight.prompt_tokens = len(plan.prompt_token_ids)
            flight.bounds = UsageBounds(len(plan.prompt_token_ids), plan.params.max_tokens)
            need = math.ceil(plan.max_total_tokens / self.pool.block_size)
            flight.ticket = await self.workers.admit(flight, plan, need)
        except BaseException as e:
            self.settlement.settle_early(flight, e)
            raise
        events = Recorder(self.workers.generate(flight, plan, need), flight, self.settlement.settle)
        return (RunToEnd(events) if idem_key else events), {"X-Cascade-Cache": "miss"}

    def _plan(self, endpoint: str, req, priority: int):
        plan = self.builder.chat(req) if endpoint == "chat" else self.builder.completion(req)
        return dataclasses.replace(plan, priority=priority)

    async def _begin_foreign(self, flight: Flight, endpoint: str, body: dict, req, request_id: str
                             ) -> tuple[AsyncIterator | dict, dict[str, str]]:
        """The pipeline for OpenAI-compatible workers: the body goes to the worker as it is; tokens
        are estimated from its characters until the worker's usage says (quotas are trued up then);
        routing and admission read the workers' own load numbers (``foreign.routing``)."""
        headers = {"X-Cascade-Cache": "miss", "X-Request-Id": request_id}
        flight.openai = "chunks" if body.get("stream") else "body"
        flight.model = str(body.get("model", ""))  # a foreign pool may serve several: priced by the one asked
        try:
            priority = request_priority(flight.key, (req.model_extra or {}).get("priority"))
            text = answers.prompt_text(endpoint, body)
            max_tokens = answers.max_tokens_of(body)
            predicted = answers.estimate_tokens(text) + (
                self.config.default_max_tokens if max_tokens is None else max_tokens)
            flight.cache_key = answers.cache_key(flight.tenant, endpoint, body)
            hit = self.cache.get(flight.cache_key) if flight.cache_key else None
            self.metrics.cache.labels("hit" if hit else "miss").inc()
            if hit is not None:
                self._check_quota(flight, 0)
                self.settlement.end_claim(flight, hit)
                self.settlement.count_flight(flight, "cache_hit")
                return hit, {**headers, "X-Cascade-Cache": "hit"}
            self._check_quota(flight, predicted)
            flight.predicted_tokens = predicted
            flight.prompt_tokens = answers.estimate_tokens(text)
            flight.bounds = foreign_bounds(endpoint, body, text, max_tokens, self.max_model_len)
            need = math.ceil(predicted / 16)
            hashes = text_block_hashes(str(body.get("model", "")), text)
            roles = ("decode",) if self.pool.by_role("decode", healthy=False) else ("both",)

            def rechoose(exclude: frozenset[str]):
                return choose(self.pool.by_role(*roles), self.text_index, hashes, priority, self.routing, need,
                              exclude)[0]

            flight.ticket, hit_blocks = choose(self.pool.by_role(*roles), self.text_index, hashes, priority,
                                               self.routing, need)
        except BaseException as e:
            self.settlement.settle_early(flight, e)
            raise

        def on_ticket(ticket) -> None:
            self.admission.release(flight.ticket)
            flight.ticket = ticket

        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        attempt = Attempt(path, body, bool(body.get("stream")), request_id, len(text), len(hashes),
                          flight.priority_class, deadline_of(flight, body))
        events = Recorder(self.proxy.run(attempt, flight.ticket, hit_blocks, rechoose, on_ticket), flight,
                          self.settlement.settle, observe_chunk)
        return (RunToEnd(events) if flight.idem_key else events), headers

    async def _claim(self, flight: Flight, body: dict) -> dict | None:
        t, k = flight.tenant, flight.idem_key
        rhash = request_hash(flight.endpoint, body)
        try:
            claim = self.idempotency.claim(t, k, rhash)
            if claim.state == ClaimState.IN_PROGRESS:  # a duplicate in flight: wait for its result
                claim = await self.idempotency.wait(t, k, self.config.request_timeout_s, request_hash=rhash)
        except ValueError as e:
            raise errors.bad_request(str(e), "Idempotency-Key", "invalid_idempotency_key") from e
        if claim.state == ClaimState.NEW:  # ours: keep the lease while the request runs
            flight.idem_owner = claim.owner
            flight.heartbeat = asyncio.get_running_loop().create_task(self.idempotency.heartbeat(t, k, claim.owner))
            return None
        if claim.state == ClaimState.DONE:
            return claim.result
        if claim.state == ClaimState.MISMATCH:
            raise errors.APIError(422, "This Idempotency-Key was used with a different request.",
                                  "invalid_request_error", "Idempotency-Key", "idempotency_key_reused")
        if claim.state == ClaimState.IN_PROGRESS:
            raise errors.APIError(409, "A request with this Idempotency-Key is still in progress.",
                                  "invalid_request_error", "Idempotency-Key", "idempotency_key_in_progress",
                                  {"Retry-After": "1"})
        return None

    def _check_quota(self, flight: Flight, predicted_tokens: int) -> None:
        key = flight.key
        tl = self.keys.tenant_limits(key.tenant)
        d = self.quotas.admit(key.tenant, key.key_id, Limits(tl.rps, tl.tpm), Limits(key.rps, key.tpm),
                              predicted_tokens)
        if d.allowed:
            try:
                self.budgets.check(key)  # after the quota, so that a request it refuses costs no spend lookup
            except errors.APIError:
                self.quotas.reconcile(key.tenant, key.key_id, predicted_tokens, 0)  # its tokens back
                raise
            return
        if d.reason == "tpm_never":
            raise errors.APIError(429, f"This request may use {predicted_tokens} tokens, more than the "
                                  f"{d.scope}'s whole per-minute quota; lower max_tokens.", "rate_limit_error",
                                  "max_tokens", "tokens_exceed_quota")
        raise errors.too_many_requests(
            f"The {d.scope}'s {'requests per second' if d.reason == 'rps' else 'tokens per minute'} quota "
            "is used up.", d.retry_after_s, f"quota_{d.reason}")

    def count(self, tenant: str, endpoint: str, outcome: str, priority_class: str = "interactive") -> None:
        self.settlement.count(tenant, endpoint, outcome, priority_class)


def deadline_of(f: Flight, body: dict) -> float | None:
    """When a request sent to an OpenAI-compatible worker must be over (``time.perf_counter``): the
    earlier of its X-Cascade-Deadline and its body's ``timeout`` (seconds), None without either."""
    limits = [t for t in (f.deadline_s, body.get("timeout")) if isinstance(t, (int, float))
              and not isinstance(t, bool) and 0 <= t < 1e9]
    return f.arrived + min(limits) if limits else None
