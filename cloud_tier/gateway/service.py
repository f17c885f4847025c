"""The gateway's request pipeline, in order: idempotency -> result cache -> validation (the
model's tokenizer) -> quotas -> KV admission -> routing -> the decode worker's event stream,
relayed as OpenAI SSE or JSON. Whatever happens, a request's commitments (KV ticket, quota
charge, idempotency claim) are settled exactly once when its event stream closes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from cascade import errors
from cascade.generation import Finish, TokenEvent, event_from_wire, event_to_wire
from cloud_tier.config import GatewayConfig
from cloud_tier.disagg.messages import RequestRecord
from cloud_tier.disagg.protocol import GenerateRequest
from cloud_tier.disagg.records import sampling_to_dict
from cloud_tier.gateway.admission import Admission, Ticket
from cloud_tier.gateway.keys import ApiKey, KeyStore
from cloud_tier.gateway.metrics import GatewayMetrics
from cloud_tier.gateway.quotas import Limits, Quotas
from cloud_tier.gateway.result_cache import ResultCache, cache_key
from cloud_tier.gateway.router import NoWorkerError, PrefixIndex, RouterConfig, choose_prefill
from cloud_tier.gateway.workers import Worker, WorkerPool
from cloud_tier.request_builder import Plan, RequestBuilder
from sync.idempotency import ClaimState, IdempotencyStore

log = logging.getLogger(__name__)

_RETRYABLE = {"prefill_unreachable", "transfer_failed", "no_capacity", "prefill_error"}


@dataclass
class Flight:
    """One admitted request's commitments and timings, settled once in ``close``."""

    tenant: str
    key: ApiKey
    endpoint: str
    arrived: float
    predicted_tokens: int = 0
    ticket: Ticket | None = None
    cache_key: str | None = None
    idem_key: str | None = None
    events: list[dict] = field(default_factory=list)
    finish: Finish | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    settled: bool = False


class Recorder:
    """Wraps a flight's event stream: records the events for the cache and idempotency store,
    and settles the flight when closed (read to the end, failed, or abandoned by the client)."""

    def __init__(self, events: AsyncIterator, flight: Flight, settle: Callable[[Flight], None]):
        self._events = events
        self.flight = flight
        self._settle = settle

    def __aiter__(self):
        return self

    async def __anext__(self):
        ev = await self._events.__anext__()
        f = self.flight
        f.events.append(event_to_wire(ev))
        if isinstance(ev, TokenEvent):
            f.last_token_at = time.perf_counter()
            if f.first_token_at is None:
                f.first_token_at = f.last_token_at
        elif isinstance(ev, Finish):
            f.finish = ev
        return ev

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            if not self.flight.settled:
                self.flight.settled = True
                self._settle(self.flight)


_END = object()
_detached: set[asyncio.Task] = set()


class RunToEnd:
    """A flight with an Idempotency-Key runs to its end even when its client goes away: its result
    is stored, and the client's retry (same key) is answered from it instead of running twice.
    The flight is read by a task of its own; the client reads what it has passed on."""

    def __init__(self, events: Recorder):
        self._events: asyncio.Queue = asyncio.Queue()
        task = asyncio.get_running_loop().create_task(self._pump(events))
        _detached.add(task)
        task.add_done_callback(_detached.discard)

    async def _pump(self, events: Recorder) -> None:
        try:
            async for ev in events:
                self._events.put_nowait(ev)
        except BaseException as e:
            self._events.put_nowait(e)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            await events.aclose()  # settles the flight: the result is stored for replays
        self._events.put_nowait(_END)

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self._events.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        """The client is gone (or done): the flight goes on without it."""


async def replay(stored: dict) -> AsyncIterator[TokenEvent | Finish]:
    for data in stored["events"]:
        yield event_from_wire(data)


def render_stored(stored: dict, fmt) -> bytes:
    """A stored result as a non-streamed body: rendered once, then only a fresh id and time."""
    body = stored.get("json")
    if body is None:
        events = [event_from_wire(e) for e in stored["events"]]
        body = stored["json"] = fmt.response(events[:-1], events[-1]).model_dump(exclude_none=True)
    return json.dumps({**body, "id": fmt.id, "created": fmt.created}, separators=(",", ":")).encode()


def request_hash(endpoint: str, body: dict) -> str:
    """What an Idempotency-Key is bound to: the request minus how it is delivered."""
    core = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return hashlib.sha256(json.dumps([endpoint, core], sort_keys=True, separators=(",", ":"),
                                     default=str).encode()).hexdigest()


class GatewayService:
    def __init__(self, config: GatewayConfig, pool: WorkerPool, keys: KeyStore, idempotency: IdempotencyStore,
                 builder: RequestBuilder, model_id: str, aliases: set[str], client: httpx.AsyncClient,
                 worker_api_key: str = ""):
        self.config = config
        self.pool = pool
        self.keys = keys
        self.idempotency = idempotency
        self.builder = builder
        self.model_id = model_id
        self.model_names = {model_id, *aliases}
        self.client = client
        self.worker_headers = {"content-type": "application/json"}
        if worker_api_key:
            self.worker_headers["authorization"] = f"Bearer {worker_api_key}"
        self.metrics = GatewayMetrics()
        self.quotas = Quotas()
        self.cache = ResultCache(config.result_cache_entries, config.result_cache_bytes, config.result_cache_ttl_s)
        self.admission = Admission(pool, config.kv_high_watermark, config.max_queue)
        self.router_config = RouterConfig(
            alpha=config.route_alpha, beta=config.route_beta, prefill_ms_per_token=config.prefill_ms_per_token,
            overload_percentile=config.overload_percentile, overload_min_tokens=config.overload_min_tokens,
            block_size=pool.block_size)
        self.index = PrefixIndex(pool.block_size, self.router_config.index_blocks_per_worker)

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

    async def begin(self, key: ApiKey, endpoint: str, body: dict, req, idem_key: str | None
                    ) -> tuple[AsyncIterator | dict, dict[str, str]]:
        """The request's event stream, or the stored result of a cache hit or a replay, and the
        response headers to add. Raises APIError (with everything already settled) when it is
        not served."""
        flight = Flight(key.tenant, key, endpoint, time.perf_counter(), idem_key=idem_key)
        if idem_key:
            stored = await self._claim(flight, body)
            if stored is not None:
                self._count(flight, "replay")
                return stored, {"X-Cascade-Idempotent-Replay": "true", "X-Cascade-Cache": "miss"}
        try:
            flight.cache_key = cache_key(key.tenant, self.model_id, endpoint, body)
            hit = self.cache.get(flight.cache_key) if flight.cache_key else None
            self.metrics.cache.labels("hit" if hit else "miss").inc()
            if hit is not None:
                self._check_quota(flight, 0)
                if idem_key:
                    self.idempotency.complete(key.tenant, idem_key, hit)
                self._count(flight, "cache_hit")
                return hit, {"X-Cascade-Cache": "hit"}
            plan = self.builder.chat(req) if endpoint == "chat" else self.builder.completion(req)
            self._check_quota(flight, plan.max_total_tokens)
            flight.predicted_tokens = plan.max_total_tokens
            need = math.ceil(plan.max_total_tokens / self.pool.block_size)
            flight.ticket = await self.admission.admit(need, self.config.ttft_slo_s, ("decode", "both"))
        except BaseException as e:
            self._settle_early(flight, e)
            raise
        events = Recorder(self._generate(flight, plan, need), flight, self._settle)
        return (RunToEnd(events) if idem_key else events), {"X-Cascade-Cache": "miss"}

    async def _claim(self, flight: Flight, body: dict) -> dict | None:
        t, k = flight.tenant, flight.idem_key
        rhash = request_hash(flight.endpoint, body)
        try:
            claim = self.idempotency.claim(t, k, rhash)
            if claim.state == ClaimState.IN_PROGRESS:  # a duplicate in flight: wait for its result
                claim = await self.idempotency.wait(t, k, self.config.request_timeout_s, request_hash=rhash)
        except ValueError as e:
            raise errors.bad_request(str(e), "Idempotency-Key", "invalid_idempotency_key") from e
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
            return
        if d.reason == "tpm_never":
            raise errors.APIError(429, f"This request may use {predicted_tokens} tokens, more than the "
                                  f"{d.scope}'s whole per-minute quota; lower max_tokens.", "rate_limit_error",
                                  "max_tokens", "tokens_exceed_quota")
        raise errors.too_many_requests(
            f"The {d.scope}'s {'requests per second' if d.reason == 'rps' else 'tokens per minute'} quota "
            "is used up.", d.retry_after_s, f"quota_{d.reason}")

    # -- running on the workers ----------------------------------------------------------

    def _route(self, plan: Plan, worker: Worker) -> tuple[str | None, Worker | None, int]:
        """(prefill URL or None for local prefill, the prefill worker, prompt tokens it computes)."""
        tokens = plan.prompt_token_ids
        prefill = self.pool.by_role("prefill") if worker.role == "decode" else []
        if not prefill:
            hit = self.index.match(tokens).get(worker.url, 0)
            self.index.insert(worker.url, tokens)
            return None, worker, len(tokens) - hit
        try:
            choice = choose_prefill([w.load() for w in prefill], self.index.match(tokens), self.router_config)
        except NoWorkerError:
            return None, worker, len(tokens)
        self.index.insert(choice.worker_id, tokens)
        return choice.worker_id, self.pool.workers[choice.worker_id], len(tokens) - choice.hit_tokens

    def _transport(self, prefill_url: str, decode_url: str) -> str:
        if self.config.kv_transport != "auto":
            return self.config.kv_transport
        return "shm" if urlsplit(prefill_url).hostname == urlsplit(decode_url).hostname else "tcp"

    async def _generate(self, flight: Flight, plan: Plan, need: int) -> AsyncIterator[TokenEvent | Finish]:
        rid = uuid.uuid4().hex
        record = RequestRecord(request_id=rid, prompt_token_ids=plan.prompt_token_ids,
                               sampling=sampling_to_dict(plan.params), priority=plan.priority)
        for attempt in range(3):
            worker = flight.ticket.worker
            prefill_url, prefill_worker, work = self._route(plan, worker)
            body = GenerateRequest(record=record.model_copy(update={"request_id": f"{rid}-{attempt}"}),
                                   prefill_url=prefill_url,
                                   transport=self._transport(prefill_url, worker.url) if prefill_url else "tcp")
            prefill_worker.pending_prefill_tokens += work
            started = False
            try:
                async with self.client.stream("POST", f"{worker.url}/internal/generate",
                                              content=body.model_dump_json(), headers=self.worker_headers) as resp:
                    if resp.status_code != 200:
                        err = _error_of(await resp.aread(), resp.status_code)
                        if err.code in _RETRYABLE and attempt < 2:
                            log.warning("attempt %d of %s failed (%s); retrying", attempt, rid, err.message)
                            if err.code == "prefill_unreachable" and prefill_url:
                                self.pool.mark_down(prefill_url, err.message)
                            continue
                        raise err
                    async for line in resp.aiter_lines():
                        if not line:
                            continue
                        data = json.loads(line)
                        if "error" in data:
                            raise errors.APIError(502, data["error"].get("message", "worker error"), "server_error",
                                                  code="worker_error")
                        ev = event_from_wire(data)
                        if not started:
                            started = True
                            prefill_worker.pending_prefill_tokens -= work
                        yield ev
                        if isinstance(ev, Finish):
                            return
                raise errors.APIError(502, "The cloud worker ended the stream without finishing.", "server_error",
                                      code="worker_failed")
            except httpx.HTTPError as e:
                self.pool.mark_down(worker.url, repr(e))
                if not started and attempt < 2 and isinstance(e, httpx.ConnectError):
                    self.admission.release(flight.ticket)  # that worker is gone: find room elsewhere
                    flight.ticket = await self.admission.admit(need, self.config.ttft_slo_s, ("decode", "both"))
                    continue
                raise errors.APIError(502, f"The cloud worker failed: {e!r}", "server_error",
                                      code="worker_failed") from e
            finally:
                if not started:
                    prefill_worker.pending_prefill_tokens -= work
        raise errors.APIError(503, "The request could not be placed on a worker; retry later.", "server_error",
                              code="no_capacity", headers={"Retry-After": "1"})

    # -- settling --------------------------------------------------------------------------

    def _settle(self, f: Flight) -> None:
        """The end of a served flight: free its KV commitment, true up its token charge, keep
        its result (cache, idempotency), count it."""
        if f.ticket is not None:
            self.admission.release(f.ticket)
        fin = f.finish
        actual = fin.prompt_tokens + fin.completion_tokens if fin else 0
        self.quotas.reconcile(f.tenant, f.key.key_id, f.predicted_tokens, actual)
        if fin is None:
            if f.idem_key:
                self.idempotency.release(f.tenant, f.idem_key)
            self._count(f, "5xx" if f.first_token_at is None else "499")
            return
        stored = {"events": f.events}
        if f.cache_key:
            self.cache.put(f.cache_key, stored, sum(len(json.dumps(e)) for e in f.events))
        if f.idem_key:
            self.idempotency.complete(f.tenant, f.idem_key, stored)
        m, t = self.metrics, f.tenant
        m.tokens_in.labels(t).inc(fin.prompt_tokens)
        m.tokens_out.labels(t).inc(fin.completion_tokens)
        ttft = (f.first_token_at or time.perf_counter()) - f.arrived
        tpot = ((f.last_token_at - f.first_token_at) / (fin.completion_tokens - 1)
                if fin.completion_tokens > 1 and f.first_token_at else 0.0)
        m.ttft.labels(t).observe(ttft)
        m.tpot.labels(t).observe(tpot)
        if ttft <= self.config.ttft_slo_s and tpot <= self.config.tpot_slo_s:
            m.goodput.labels(t).inc()
        self._count(f, "ok")

    def _settle_early(self, f: Flight, error: BaseException) -> None:
        """Not served (an APIError before streaming, or cancelled): undo what was taken."""
        f.settled = True
        if f.ticket is not None:
            self.admission.release(f.ticket)
        if f.predicted_tokens:
            self.quotas.reconcile(f.tenant, f.key.key_id, f.predicted_tokens, 0)
        if f.idem_key:
            self.idempotency.release(f.tenant, f.idem_key)
        if isinstance(error, errors.APIError):
            code = error.body()["error"].get("code") or ""
            outcome = f"429_{code}" if error.status == 429 else f"{error.status // 100}xx"
        else:
            outcome = "499"
        self._count(f, outcome)

    def _count(self, f: Flight, outcome: str) -> None:
        self.metrics.requests.labels(f.tenant, f.endpoint, outcome).inc()


def _error_of(content: bytes, status: int) -> errors.APIError:
    try:
        e = json.loads(content)["error"]
        return errors.APIError(status if status >= 500 else 502, e.get("message", ""), "server_error",
                               code=e.get("code") or "worker_error")
    except (ValueError, KeyError, TypeError):
        return errors.APIError(502, f"the worker answered {status}", "server_error", code="worker_error")
