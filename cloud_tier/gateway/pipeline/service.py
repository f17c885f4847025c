"""The gateway's request pipeline, in order: idempotency -> validation (our model's tokenizer,
or a foreign request's text) -> result cache -> quotas -> admission and routing -> the worker's
event stream, handed back as a typed result (``pipeline.results``) that the HTTP shell relays as
OpenAI SSE or JSON and the batch runner reads whole. The steps where our workers and foreign
ones differ are behind one interface (``pipeline.steps``). Whatever happens, a request's
commitments (KV ticket, quota charge, idempotency claim) are settled exactly once when its event
stream closes (``pipeline.recorder``, ``pipeline.settlement``)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time

import httpx

from cascade import errors
from cloud_tier.config import GatewayConfig, parse_class_slos
from cloud_tier.gateway.foreign.proxy import OpenAIProxy, ProxyConfig
from cloud_tier.gateway.foreign.routing import ForeignRouting
from cloud_tier.gateway.pipeline.flight import Flight
from cloud_tier.gateway.pipeline.foreign_workers import ForeignWorkers
from cloud_tier.gateway.pipeline.metrics import GatewayMetrics
from cloud_tier.gateway.pipeline.own_workers import OwnWorkers
from cloud_tier.gateway.pipeline.recorder import Recorder, RunToEnd
from cloud_tier.gateway.pipeline.result_cache import ResultCache
from cloud_tier.gateway.pipeline.results import Result, stored
from cloud_tier.gateway.pipeline.settlement import Settlement, outcome_of
from cloud_tier.gateway.pipeline.state import Quota
from cloud_tier.gateway.pipeline.steps import WorkerSteps
from cloud_tier.gateway.pipeline.stores import Stores
from cloud_tier.gateway.pipeline.worker_client import WorkerClient
from cloud_tier.gateway.tenants.budgets import Spend
from cloud_tier.gateway.tenants.keys import ApiKey, check_priority
from cloud_tier.gateway.tenants.quotas import Limits, QuotaDecision
from cloud_tier.gateway.workers.admission import Admission
from cloud_tier.gateway.workers.http_client import WorkerHTTP
from cloud_tier.gateway.workers.placement import PrefixIndex, RouterConfig
from cloud_tier.gateway.workers.pool import WorkerPool
from cloud_tier.request_builder import RequestBuilder, check_slo_floors
from sync.idempotency import ClaimState

log = logging.getLogger(__name__)
_ADMITTED = object()  # a miss admitted by its cache lookup (one round trip): no second admission

def state_unavailable(what: str, error: BaseException) -> errors.APIError:
    """The 503 of a request that needed a store that cannot be reached now."""
    log.warning("the gateway's %s is unreachable: %s", what, error)
    return errors.APIError(503, f"The gateway's {what} is unreachable; retry shortly.", "server_error",
                           code="state_unavailable", headers={"Retry-After": "1"})


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
    """The pipeline over one pool of workers; ``begin`` runs a request through it. The steps in
    which the pool's kind of worker differs are ``own`` (our workers) or ``foreign`` (OpenAI-
    compatible ones), chosen per request by the pool's mode (``pipeline.steps``)."""

    def __init__(self, config: GatewayConfig, pool: WorkerPool, stores: Stores, builder: RequestBuilder | None,
                 model_id: str, aliases: set[str], client: httpx.AsyncClient, worker_api_key: str = "",
                 max_model_len: int | None = None, http: WorkerHTTP | None = None):
        self.config = config
        self.pool = pool
        self.keys = stores.keys
        self.idempotency = stores.idempotency
        self.model_id = model_id
        self.model_names = {model_id, *aliases}
        self.max_model_len = max_model_len
        self.metrics = GatewayMetrics(config.metrics_tenant_labels)
        self.quotas = stores.quotas
        self.cache = stores.cache
        self.budgets = stores.budgets
        self.state = stores.state
        self.admission = Admission.of(pool, config)
        self.settlement = Settlement(config, stores, self.admission, self.metrics, model_id)
        http = http or WorkerHTTP(config.connect_timeout_s, config.request_timeout_s)
        workers = _worker_client(config, pool, http, self.admission, worker_api_key)
        cache_keys = ResultCache(config.result_cache_entries, ttl_s=config.result_cache_ttl_s)
        self.own = OwnWorkers(builder, model_id, pool, workers, cache_keys)
        self.foreign = _foreign_workers(config, pool, http, self.admission, worker_api_key, max_model_len)
        self.routing = self.foreign.routing  # the foreign workers' load, as /metrics and the batch runner read it
        self.embedding_identity = ""  # our workers' ServedModel.embedding_identity (the app sets it): card meta

    # -- auth ----------------------------------------------------------------------------

    async def authenticate(self, authorization: str, scope: str = "infer") -> ApiKey:
        scheme, _, token = authorization.partition(" ")
        try:
            key = await self.keys.verify_async(token.strip()) if scheme.lower() == "bearer" else None
        except ConnectionError as e:
            raise state_unavailable("key store", e) from e
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
                    deadline_s: float | None = None) -> Result:
        """The request's result (``pipeline.results``): its event stream, or the stored answer of
        a cache hit or a replay, with the response headers to add. Raises APIError (with
        everything already settled) when it is not served."""
        flight = Flight(key.tenant, key, endpoint, time.perf_counter(), idem_key=idem_key,
                        priority_class=priority_class, deadline_s=deadline_s)
        try:  # what the tenant may ask of the engines, before anything is claimed
            check_slo_floors(req.model_extra or {}, *(await self._tenant_limits(key.tenant)).slo_floors(
                self.config.min_ttft_slo_s, self.config.min_tpot_slo_s))
        except errors.APIError as e:
            self.settlement.count_flight(flight, outcome_of(e))
            raise
        if idem_key:
            replayed = await self._claim(flight, body)
            if replayed is not None:
                self.settlement.count_flight(flight, "replay")
                return stored(replayed, {"X-Cascade-Idempotent-Replay": "true", "X-Cascade-Cache": "miss"})
        steps: WorkerSteps = self.foreign if self.pool.foreign else self.own
        try:
            priority = request_priority(key, (req.model_extra or {}).get("priority"))
            # a schema, tools or a long prompt: rendered, tokenized and compiled off the event loop
            plan = (await asyncio.to_thread(self.own.plan, endpoint, req, priority)
                    if steps is self.own and req.costly_to_plan() else None)
            job = steps.prepare(flight, endpoint, body, req, priority, request_id, plan)
            estimate = job.estimate() if job.estimate_ready() else None
            # the cache, the quota (a hit's, or a miss's with its predicted tokens) and the spend: one round trip
            hit, looked_up = await self._lookup(flight, None if estimate is None else estimate.predicted_tokens)
            self.metrics.cache_lookup(hit is not None)
            if hit is not None:
                await self.settlement.end_claim(flight, hit)
                self.settlement.count_flight(flight, "cache_hit")
                return stored(hit, {**job.headers, "X-Cascade-Cache": "hit"})
            estimate = estimate or job.estimate()
            if looked_up is not _ADMITTED:
                await self._check_quota(flight, estimate.predicted_tokens, looked_up)
            flight.predicted_tokens = estimate.predicted_tokens
            flight.prompt_tokens = estimate.prompt_tokens
            flight.bounds = estimate.bounds
            await job.admit()
        except BaseException as e:
            await self.settlement.settle_early(flight, e)
            raise
        events = Recorder(job.events(), flight, self.settlement.settle, job.observe)
        return job.answer(RunToEnd(events) if idem_key else events)

    async def _claim(self, flight: Flight, body: dict) -> dict | None:
        t, k = flight.tenant, flight.idem_key
        rhash = request_hash(flight.endpoint, body)
        try:
            claim = await self.idempotency.aclaim(t, k, rhash)
            if claim.state == ClaimState.IN_PROGRESS:  # a duplicate in flight: wait for its result
                claim = await self.idempotency.wait(t, k, self.config.request_timeout_s, request_hash=rhash)
        except ValueError as e:
            raise errors.bad_request(str(e), "Idempotency-Key", "invalid_idempotency_key") from e
        except ConnectionError as e:
            raise state_unavailable("idempotency store", e) from e
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

    async def _tenant_limits(self, tenant: str):
        try:
            return await self.keys.tenant_limits_async(tenant)
        except ConnectionError as e:
            raise state_unavailable("key store", e) from e

    async def _quota_of(self, flight: Flight) -> tuple[Quota, list[Spend]]:
        """Who asks (their limits), and the active budgets their request must fit."""
        key = flight.key
        tl = await self._tenant_limits(key.tenant)
        try:
            due = await self.budgets.due(key)
        except ConnectionError as e:
            raise state_unavailable("key store", e) from e
        return Quota(key.tenant, key.key_id, Limits(tl.rps, tl.tpm), Limits(key.rps, key.tpm)), due

    async def _lookup(self, flight: Flight, predicted_tokens: int | None) -> tuple[object | None, object]:
        """The cached answer (None: a miss), already admitted against the quota and the budgets
        when a hit (a 429 when they refuse it), or on a miss with ``predicted_tokens`` in the same
        call (``_ADMITTED``); otherwise what ``_check_quota`` needs of that round trip (None:
        nothing was looked up)."""
        if not flight.cache_key:
            return None, None
        q, due = await self._quota_of(flight)
        try:
            found = await self.state.lookup(q, flight.cache_key, [(s.scope, s.name, s.period_id) for s in due],
                                            miss_tokens=predicted_tokens)
        except ConnectionError as e:
            raise state_unavailable("spend counters", e) from e
        if found.hit is not None:
            self._decide(found.decision, 0)
            await self._check_budgets(q, due, 0, found.spent)
        elif found.admitted:
            self._decide(found.decision, predicted_tokens)  # refused: nothing was taken
            await self._check_budgets(q, due, predicted_tokens, found.spent)  # refused: its tokens back
            return None, _ADMITTED
        return found.hit, (q, due, found.spent)

    async def _check_quota(self, flight: Flight, predicted_tokens: int, looked_up: tuple | None = None) -> None:
        """Take the request and ``predicted_tokens`` from its quota (429 when it refuses), then
        check its budgets (their spend read in the same round trip, or by the lookup before)."""
        q, due, spent = looked_up or (*(await self._quota_of(flight)), None)
        try:
            d, read = await self.state.admit(
                q, predicted_tokens, [(s.scope, s.name, s.period_id) for s in due] if spent is None else [])
        except ConnectionError as e:
            raise state_unavailable("spend counters", e) from e
        self._decide(d, predicted_tokens)
        await self._check_budgets(q, due, predicted_tokens, read if spent is None else spent)

    async def _check_budgets(self, q: Quota, due: list[Spend], predicted_tokens: int, spent: list) -> None:
        # after the quota, so that a request it refuses is refused for its quota, as before
        try:
            self.budgets.refuse_spent(due, spent)
        except errors.APIError:
            await self.state.reconcile(q, predicted_tokens, 0)  # its tokens back
            raise

    @staticmethod
    def _decide(d: QuotaDecision, predicted_tokens: int) -> None:
        if d.allowed:
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


def _worker_client(config: GatewayConfig, pool: WorkerPool, http: WorkerHTTP, admission: Admission,
                   worker_api_key: str) -> WorkerClient:
    router_config = RouterConfig(
        alpha=config.route_alpha, beta=config.route_beta, prefill_ms_per_token=config.prefill_ms_per_token,
        overload_percentile=config.overload_percentile, overload_min_tokens=config.overload_min_tokens,
        block_size=pool.block_size)
    index = PrefixIndex(pool.block_size, router_config.index_blocks_per_worker)
    return WorkerClient(pool, http, admission, index, router_config, config.kv_transport, config.ttft_slo_s,
                        worker_api_key, parse_class_slos(config.class_slos), config.worker_max_event_bytes,
                        config.worker_max_body_bytes)


def _foreign_workers(config: GatewayConfig, pool: WorkerPool, http: WorkerHTTP, admission: Admission,
                     worker_api_key: str, max_model_len: int | None) -> ForeignWorkers:
    """Foreign workers (vLLM, SGLang, any OpenAI-compatible server): no tokenizer, their own load numbers."""
    routing = ForeignRouting(
        max_waiting=config.worker_max_waiting, kv_high_watermark=config.kv_high_watermark,
        stale_after_s=config.stale_after_s, shed_step=config.shed_step, prefix_weight=config.route_prefix_weight,
        queue_weight=config.route_queue_weight, kv_weight=config.route_kv_weight)
    proxy = OpenAIProxy(pool, http, ProxyConfig(
        retries=config.retries, retry_backoff_s=config.retry_backoff_s,
        first_token_timeout_s=config.first_token_timeout_s, answer_timeout_s=config.request_timeout_s,
        max_event_bytes=config.worker_max_event_bytes, max_body_bytes=config.worker_max_body_bytes,
        kv_connector=config.kv_connector,
        pd_min_prompt_chars=config.pd_min_prompt_chars, pd_skip_hit_share=config.pd_skip_hit_share,
        vllm_priority=config.foreign_priority), worker_api_key)
    text_index = PrefixIndex(1, RouterConfig().index_blocks_per_worker)
    return ForeignWorkers(pool, admission, routing, text_index, proxy, config.default_max_tokens, max_model_len)
