"""Running a placed request on the workers: choose the prefill worker (prefix- and load-aware),
call the decode worker's ``/internal/generate`` and relay its NDJSON events; retry on another
attempt what failed before the first token for a reason a retry can fix (a prefill worker
unreachable, a transfer that failed, no KV room), and find another decode worker when the
chosen one cannot be reached. The worker's answer is read bounded (``workers.stream``: a line up to
``max_event_bytes``, an error body up to ``max_body_bytes``), each line by the strict decoder; a
worker that stalls is a 504 (a timeout, or the request's deadline passed by ``DEADLINE_GRACE_S``:
the worker keeps the deadline itself, the gateway only in case it does not)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp

from cascade import errors
from cascade.generation import Finish, TokenEvent, event_from_wire
from cloud_tier.disagg.messages import RequestRecord
from cloud_tier.disagg.protocol import GenerateRequest
from cloud_tier.draft import draft_fields
from cloud_tier.gateway.pipeline.flight import Flight
from cloud_tier.gateway.workers import stream as worker_stream
from cloud_tier.gateway.workers.admission import Admission, Ticket
from cloud_tier.gateway.workers.http_client import Unreachable, WorkerBroke, WorkerHTTP, read_some
from cloud_tier.gateway.workers.placement import NoWorkerError, PrefixIndex, RouterConfig, choose_prefill
from cloud_tier.gateway.workers.pool import Worker, WorkerPool
from cloud_tier.request_builder import RequestPlan

log = logging.getLogger(__name__)

_RETRYABLE = {"prefill_unreachable", "transfer_failed", "no_capacity", "prefill_error"}
ATTEMPTS = 3
DEADLINE_GRACE_S = 0.5


class WorkerClient:
    def __init__(self, pool: WorkerPool, http: WorkerHTTP, admission: Admission, index: PrefixIndex,
                 router_config: RouterConfig, kv_transport: str, ttft_slo_s: float, worker_api_key: str = "",
                 class_slos: dict[str, tuple[float, float]] | None = None, max_event_bytes: int = 1 << 20,
                 max_body_bytes: int = 32 << 20):
        self.pool = pool
        self.http = http  # aiohttp: a token's event read at a fraction of httpx's cost
        self.admission = admission
        self.index = index
        self.router_config = router_config
        self.kv_transport = kv_transport
        self.ttft_slo_s = ttft_slo_s
        self.class_slos = class_slos or {}
        self.max_event_bytes = max_event_bytes
        self.max_body_bytes = max_body_bytes
        self.worker_headers = {"content-type": "application/json"}
        if worker_api_key:
            self.worker_headers["authorization"] = f"Bearer {worker_api_key}"

    def targets(self, flight: Flight, plan: RequestPlan) -> tuple[float | None, float | None]:
        """The request's (TTFT, TPOT) targets: its own (the body's), else its class's in ``class_slos``."""
        ttft, tpot = self.class_slos.get(flight.priority_class, (None, None))
        return plan.ttft_slo_s or ttft, plan.tpot_slo_s or tpot

    async def admit(self, flight: Flight, plan: RequestPlan, need: int) -> Ticket:
        """Room for the request on a decode worker: waited for up to what is left of its TTFT target
        (refused as "slo" past it: it would miss it anyway), or of the gateway's TTFT objective when
        it has none."""
        target = self.targets(flight, plan)[0]
        wait_s, reason = ((self.ttft_slo_s, "kv_capacity") if target is None else
                          (max(0.0, target - (time.perf_counter() - flight.arrived)), "slo"))
        return await self.admission.admit(need, wait_s, ("decode", "both"), reason=reason,
                                          batch=flight.priority_class == "batch", tenant=flight.tenant)

    def route(self, plan: RequestPlan, worker: Worker) -> tuple[str | None, Worker | None, int]:
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

    def transport(self, prefill_url: str, decode_url: str) -> str:
        if self.kv_transport != "auto":
            return self.kv_transport
        return "shm" if urlsplit(prefill_url).hostname == urlsplit(decode_url).hostname else "tcp"

    def _record(self, flight: Flight, plan: RequestPlan, rid: str) -> RequestRecord:
        ttft, tpot = self.targets(flight, plan)
        return RequestRecord(request_id=rid, prompt_token_ids=plan.prompt_token_ids,
                             sampling=plan.params.to_dict(), priority=plan.priority,
                             priority_class=flight.priority_class, tenant=flight.tenant,
                             ttft_slo_s=ttft, tpot_slo_s=tpot, timeout_s=time_left(flight, plan),
                             **draft_fields(plan.draft))

    async def generate(self, flight: Flight, plan: RequestPlan, need: int) -> AsyncIterator[TokenEvent | Finish]:
        rid = uuid.uuid4().hex
        record = self._record(flight, plan, rid)
        deadline = None if record.timeout_s is None else time.perf_counter() + record.timeout_s
        for attempt in range(ATTEMPTS):
            worker = flight.ticket.worker
            prefill_url, prefill_worker, work = self.route(plan, worker)
            waited = time.perf_counter() - flight.arrived  # the worker's TTFT clock starts at our arrival
            body = GenerateRequest(record=record.model_copy(update={"request_id": f"{rid}-{attempt}",
                                                                    "waited_s": min(waited, 86400.0)}),
                                   prefill_url=prefill_url,
                                   transport=self.transport(prefill_url, worker.url) if prefill_url else "tcp")
            prefill_worker.pending_prefill_tokens += work
            started = False
            try:
                resp = await self.http.send("POST", f"{worker.url}/internal/generate", body.model_dump_json().encode(),
                                            self.worker_headers)
                try:
                    if resp.status != 200:
                        await self._refused(resp, attempt, rid, prefill_url)  # raises unless a retry may fix it
                        continue
                    lines = worker_stream.LineReader(lambda r=resp: read_some(r), self.max_event_bytes)
                    while True:
                        if deadline is None:
                            line = await lines.line()
                        else:
                            async with asyncio.timeout(_backstop(deadline)):
                                line = await lines.line()
                        if line is None:
                            break
                        if not line.strip():
                            continue
                        ev = self._event_of(line, flight)
                        if not started:
                            started = True
                            prefill_worker.pending_prefill_tokens -= work
                        yield ev
                        if isinstance(ev, Finish):
                            return
                finally:
                    resp.release()
                raise errors.APIError(502, "The cloud worker ended the stream without finishing.", "server_error",
                                      code="worker_failed")
            except TimeoutError as e:
                raise _timed_out(deadline) from e
            except (Unreachable, WorkerBroke) as e:
                self.pool.mark_down(worker.url, str(e))
                if not started and attempt < ATTEMPTS - 1 and isinstance(e, Unreachable):
                    self.admission.release(flight.ticket)  # that worker is gone: find room elsewhere
                    flight.ticket = await self.admit(flight, plan, need)
                    continue
                log.warning("worker %s failed: %s", worker.url, e)  # its address is internal: not in the answer
                raise errors.APIError(502, "The cloud worker could not be reached." if isinstance(e, Unreachable)
                                      else "The cloud worker's connection broke.", "server_error",
                                      code="worker_failed") from e
            finally:
                if not started:
                    prefill_worker.pending_prefill_tokens -= work
        raise errors.APIError(503, "The request could not be placed on a worker; retry later.", "server_error",
                              code="no_capacity", headers={"Retry-After": "1"})

    async def _refused(self, resp: aiohttp.ClientResponse, attempt: int, rid: str, prefill_url: str | None) -> None:
        """A worker's refusal: raised as the answer, unless another attempt may fix it."""
        content = await worker_stream.read_all(resp.headers, lambda: read_some(resp), self.max_body_bytes)
        err = worker_stream.error_of(content, resp.status, resp.headers)
        if err.code in _RETRYABLE and attempt < ATTEMPTS - 1:
            log.warning("attempt %d of %s failed (%s); retrying", attempt, rid, err.message)
            if err.code == "prefill_unreachable" and prefill_url:
                self.pool.mark_down(prefill_url, err.message)
            return
        raise err

    def _event_of(self, line: bytes, flight: Flight) -> TokenEvent | Finish:
        """One NDJSON line of the worker's stream as an event; an in-band error raises (502). A
        finish whose usage is not integers is refused: the flight's own counts stand in."""
        data = worker_stream.decode(line, self.max_event_bytes, "an event")
        if isinstance(data, dict) and "error" in data:
            message = data["error"].get("message") if isinstance(data["error"], dict) else None
            raise errors.APIError(502, str(message or "worker error")[:500], "server_error", code="worker_error")
        if isinstance(data, dict) and isinstance(fin := data.get("finish"), list) and not all(
                isinstance(x, int) and not isinstance(x, bool) for x in fin[1:4]):
            flight.usage_problem = "not_integer"  # refused: our own counts stand in
            fin[1:4] = [flight.prompt_tokens, flight.generated_tokens, 0]
        try:
            return event_from_wire(data)
        except (ValueError, TypeError, AttributeError):
            raise errors.APIError(502, f"The cloud worker sent an event that is not one: "
                                  f"{line[:100]!r}", "server_error", code="worker_bad_stream") from None


def _timed_out(deadline: float | None) -> errors.APIError:
    late = deadline is not None and time.perf_counter() >= deadline
    return errors.APIError(504, "The request's deadline passed." if late else
                           "The cloud worker did not answer in time.", "server_error",
                           code="deadline_exceeded" if late else "worker_timeout")


def time_left(flight: Flight, plan: RequestPlan) -> float | None:
    """What is left of the request's deadline (the earlier of the body's ``timeout`` and the
    X-Cascade-Deadline header), for the worker: a duration, since clocks differ between hosts."""
    limits = [t for t in (plan.timeout_s, flight.deadline_s) if t is not None]
    if not limits:
        return None
    return max(0.0, min(limits) - (time.perf_counter() - flight.arrived))


def _backstop(deadline: float | None) -> float | None:
    """Seconds the next line may take: until the request's deadline (``time.perf_counter``, kept
    by the worker too) and its grace; None without a deadline."""
    return None if deadline is None else max(0.0, deadline + DEADLINE_GRACE_S - time.perf_counter())
