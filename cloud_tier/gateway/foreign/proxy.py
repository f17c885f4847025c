"""Forwarding a request to an OpenAI-compatible worker (vLLM, SGLang, ours) unchanged, and
relaying its answer: the chunks of a stream (``stream_options.include_usage`` forced, so the
gateway learns the worker's real usage; the usage chunk is dropped again for a client that did
not ask for it) or its one JSON body. ``X-Request-Id`` goes to the worker and back.

Failures: a worker that cannot be reached, answers 408, 429 or 5xx, or ends its stream with no
chunk, is retried on another worker with backoff (never on one that already failed this request:
the same request there fails the same way), but only before the first byte has been passed on; a
stream whose first chunk does not come within ``first_token_timeout_s``, or an answer not whole
within ``answer_timeout_s``, fails (504). A request's deadline (X-Cascade-Deadline, the body's
``timeout``) goes to the worker as ``X-Cascade-Deadline`` (ours ends the answer there) and is kept
by the gateway too, ``DEADLINE_GRACE_S`` later: before the first byte a 504, after it the stream
ends with an error event. A worker's answer is read bounded (``workers.stream``: an event up to
``max_event_bytes``, a body up to ``max_body_bytes``) and its shape checked (``foreign.shape``)
before anything of it is relayed or stored: one that is not OpenAI-shaped is a 502. A request
counts at most once on the worker's circuit breaker, and only for what says the worker itself is
unwell (``worker_is_unwell``: no connection, a timeout, 502/503/504, an answer that is not
OpenAI-shaped; a connect error also takes it out of the pool until its health check passes
again), never for a 500 with an OpenAI error body or a 429, which one tenant's request can cause;
a success closes it.

vLLM prefill/decode pairs (NixlConnector): the prompt is prefilled on a prefill worker with
``max_tokens`` 1 and ``kv_transfer_params: {do_remote_decode: true}``, then decoded on a decode
worker with the ``kv_transfer_params`` the prefill returned, both under one request id; a short
prompt, or one the decode worker mostly holds already, skips the prefill, and a failed prefill
falls back to decoding alone."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
import orjson

from cascade import errors
from cloud_tier.gateway.foreign.shape import body_problem, chunk_problem, worker_is_unwell
from cloud_tier.gateway.tenants.priority import with_vllm_priority
from cloud_tier.gateway.workers import stream as worker_stream
from cloud_tier.gateway.workers.admission import Ticket
from cloud_tier.gateway.workers.http_client import Unreachable, WorkerBroke, WorkerHTTP, end_of_body, read_some
from cloud_tier.gateway.workers.pool import Worker, WorkerPool

log = logging.getLogger(__name__)

_RETRY_STATUS = {408, 429}
DEADLINE_GRACE_S = 0.5  # a worker that keeps the deadline itself (ours) ends its answer within this
_NIXL_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass(frozen=True)
class ProxyConfig:
    retries: int = 2  # further attempts, before the first byte only
    retry_backoff_s: float = 0.1  # doubled per attempt, with jitter
    first_token_timeout_s: float = 60.0
    answer_timeout_s: float = 600.0  # a non-streamed answer, whole
    max_event_bytes: int = 1 << 20  # one SSE event of a worker's stream
    max_body_bytes: int = 32 << 20  # a worker's non-streamed answer (or its error body)
    kv_connector: str = ""  # "nixl": prefill/decode pairs of vLLM workers
    pd_min_prompt_chars: int = 1024  # shorter prompts skip the prefill step
    pd_skip_hit_share: float = 0.8  # ... as do prompts the decode worker holds this much of
    vllm_priority: bool = False  # a request's class as vLLM's priority (workers run --scheduling-policy priority)


@dataclass
class Attempt:
    """The request as it goes to a worker, and what the route needs back."""

    path: str  # /v1/chat/completions | /v1/completions
    body: dict
    stream: bool
    request_id: str
    prompt_chars: int
    hashes_total: int  # prompt blocks (for the share a hit covers)
    priority_class: str = "interactive"
    deadline: float | None = None  # time.perf_counter() when the request must be over

    def time_left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.perf_counter())


class OpenAIProxy:
    def __init__(self, pool: WorkerPool, http: WorkerHTTP, config: ProxyConfig, worker_api_key: str = "",
                 rng: random.Random | None = None):
        self.pool = pool
        self.http = http
        self.config = config
        self.headers = {"content-type": "application/json"}
        if worker_api_key:
            self.headers["authorization"] = f"Bearer {worker_api_key}"
        self.rng = rng or random.Random()

    async def run(self, a: Attempt, ticket: Ticket, hit_blocks: int,
                  rechoose: Callable[[frozenset[str]], Ticket], on_ticket: Callable[[Ticket], None]
                  ) -> AsyncIterator[dict | tuple[dict, bytes]]:
        """The worker's chunks (stream: each as (the chunk, its bytes)) or its one body (a dict). ``rechoose``
        gives a ticket on another worker for a retry (the old one is released by ``on_ticket``)."""
        tried: set[str] = set()
        body = dict(a.body)
        if a.stream:
            body["stream_options"] = {**(a.body.get("stream_options") or {}), "include_usage": True}
        for attempt in range(self.config.retries + 1):
            worker = ticket.worker
            tried.add(worker.url)
            sent = body
            if self.config.vllm_priority and worker.kind == "vllm":
                sent = with_vllm_priority(body, a.priority_class)
            sent = await self._with_prefill(a, sent, worker, hit_blocks)
            started = False
            try:
                async for item in self._send(worker, a, sent):
                    started = True
                    yield item
                return
            except _Retryable as e:
                if started or attempt == self.config.retries:
                    raise e.error from None
                try:  # never the worker that just failed it: the same request there fails the same way
                    ticket = rechoose(frozenset(tried))
                except errors.APIError:
                    raise e.error from None
                on_ticket(ticket)
                log.warning("worker %s: %s; retrying on %s (attempt %d)", worker.url, e.error.message,
                            ticket.worker.url, attempt + 1)
                await asyncio.sleep(self.config.retry_backoff_s * (2 ** attempt) * (0.5 + self.rng.random()))
                hit_blocks = 0

    async def _send(self, w: Worker, a: Attempt, body: dict) -> AsyncIterator[dict | tuple[dict, bytes]]:
        """The worker's answer: its one body (a dict), or its stream's chunks, each as (the chunk,
        its bytes as the worker wrote them), relayed unchanged unless the gateway changes it."""
        cfg = self.config
        chat = a.path.endswith("/chat/completions")
        resp = None
        counted = False  # a request counts at most once on the worker's breaker

        def failed(why: str, down: bool = False) -> None:
            nonlocal counted
            if not counted:
                counted = True
                self._failed(w, why, down)

        yielded = False
        try:
            async with asyncio.timeout(_within(cfg.first_token_timeout_s if a.stream else cfg.answer_timeout_s, a)):
                resp = await self.http.send("POST", f"{w.url}{a.path}", orjson.dumps(body), self._headers(a))
                first, reader = await self._first(resp, w, a, chat, failed)  # headers, then the first chunk, in time
                self._ok(w)
            yielded = True
            yield first
            if reader is not None:
                while True:
                    if a.deadline is None:  # no timer a chunk: the read timeout bounds a stall
                        item = await reader.next()
                    else:
                        async with asyncio.timeout(_within(None, a)):
                            item = await reader.next()
                    if item is None:
                        break
                    _check_chunk(item[0], chat)
                    yield item
                await end_of_body(resp)
        except errors.APIError as e:
            # the worker's 200 that is not an OpenAI answer: its own failure (retried elsewhere before
            # the first byte); an OpenAI error event in its stream is the request's, as a 500 is
            if resp is not None and resp.status == 200 and e.code in _UNWELL_CODES:
                failed(e.message)
                if not yielded:
                    raise _Retryable(e) from None
            raise
        except Unreachable as e:  # the client's message names no worker (its address is internal): the log does
            failed(str(e), down=True)
            raise _Retryable(errors.APIError(502, "The cloud worker could not be reached.", "server_error",
                                             code="worker_unreachable")) from e
        except TimeoutError as e:
            if a.deadline is not None and time.perf_counter() >= a.deadline:
                raise errors.APIError(504, "The request's deadline passed before the cloud worker's answer was "
                                      "whole.", "server_error", code="deadline_exceeded") from e
            failed("no first token in time" if not yielded else "no answer in time")
            raise errors.APIError(504, "The cloud worker did not answer in time.", "server_error",
                                  code="worker_timeout") from e
        except WorkerBroke as e:
            failed(str(e))
            raise errors.APIError(502, "The cloud worker's connection broke.", "server_error",
                                  code="worker_failed") from e
        finally:
            if resp is not None:
                resp.release()  # back to the pool when its body was read to the end, else closed

    def _headers(self, a: Attempt) -> dict[str, str]:
        headers = {**self.headers, "x-request-id": a.request_id}
        if (left := a.time_left()) is not None:
            headers["x-cascade-deadline"] = f"{left:.3f}"
        return headers

    async def _first(self, resp: aiohttp.ClientResponse, w: Worker, a: Attempt, chat: bool,
                     failed: Callable[[str], None]) -> tuple[object, worker_stream.ChunkReader | None]:
        """The answer's first part: the whole body, or a stream's first chunk and the reader of the
        rest. A refusal raises, as ``_Retryable`` where another worker may answer it."""
        cfg = self.config
        if resp.status != 200:
            content = await worker_stream.read_all(resp.headers, lambda: read_some(resp), cfg.max_body_bytes)
            err = worker_stream.error_of(content, resp.status, resp.headers)
            if resp.status in _RETRY_STATUS or resp.status >= 500:
                if worker_is_unwell(resp.status, content):
                    failed(f"answered {resp.status}")
                raise _Retryable(err)
            self._ok(w)
            raise err
        if not a.stream:
            first = worker_stream.decode(
                await worker_stream.read_all(resp.headers, lambda: read_some(resp), cfg.max_body_bytes),
                cfg.max_body_bytes, "an answer")
            if why := body_problem(first, chat):
                raise _bad_answer(f"The cloud worker answered something that is not a completion: {why}.",
                                  "worker_bad_response")
            return first, None
        reader = worker_stream.ChunkReader(lambda: read_some(resp), cfg.max_event_bytes, cfg.answer_timeout_s)
        first = await reader.next()
        if first is None:
            raise _bad_answer("The cloud worker's stream ended with no chunk.", "worker_empty_stream")
        _check_chunk(first[0], chat)
        return first, reader

    async def _with_prefill(self, a: Attempt, body: dict, decode: Worker, hit_blocks: int) -> dict:
        """The body for the decode worker, after the prefill step of a vLLM P/D pair (if any)."""
        if self.config.kv_connector != "nixl" or decode.role != "decode":
            return body
        share = hit_blocks / a.hashes_total if a.hashes_total else 0.0
        if a.prompt_chars < self.config.pd_min_prompt_chars or share >= self.config.pd_skip_hit_share:
            return body
        prefill = [w for w in self.pool.by_role("prefill") if w.available()]
        if not prefill:
            return body
        p = min(prefill, key=lambda w: (w.in_flight, w.url))
        req = {k: v for k, v in body.items() if k != "stream_options"}
        req.update(stream=False, max_tokens=1, kv_transfer_params=dict(_NIXL_PREFILL))
        if "max_completion_tokens" in req:
            req["max_completion_tokens"] = 1
        p.in_flight += 1
        try:
            limit = self.config.max_body_bytes
            async with asyncio.timeout(self.config.first_token_timeout_s):
                r = await self.http.send("POST", f"{p.url}{a.path}", orjson.dumps(req),
                                         {**self.headers, "x-request-id": a.request_id})
                try:
                    content = await worker_stream.read_all(r.headers, lambda: read_some(r), limit)
                    if r.status != 200:
                        raise _Refused(r.status, worker_is_unwell(r.status, content))
                    answer = worker_stream.decode(content, limit, "a prefill answer")
                finally:
                    r.close()
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            self._ok(p)
        except (Unreachable, WorkerBroke, TimeoutError, ValueError, errors.APIError) as e:
            if not isinstance(e, _Refused) or e.unwell:  # a refusal of this request's content is not the worker's
                self._failed(p, repr(e), down=isinstance(e, Unreachable))
            log.warning("prefill on %s failed (%r); decoding on %s alone", p.url, e, decode.url)
            return body
        finally:
            p.in_flight -= 1
        return {**body, "kv_transfer_params": params} if isinstance(params, dict) else body

    def _ok(self, w: Worker) -> None:
        if w.breaker is not None:
            w.breaker.success()

    def _failed(self, w: Worker, why: str, down: bool = False) -> None:
        log.warning("worker %s failed: %s", w.url, why)
        w.last_error = why
        if w.breaker is not None:
            w.breaker.failure(why)
        if down:
            self.pool.mark_down(w.url, why)


class _Retryable(Exception):
    def __init__(self, error: errors.APIError):
        super().__init__(error.message)
        self.error = error


class _Refused(ValueError):
    def __init__(self, status: int, unwell: bool):
        super().__init__(f"answered {status}")
        self.unwell = unwell


def _within(timeout_s: float | None, a: Attempt) -> float | None:
    """``timeout_s``, or less when the request's deadline (and its grace) comes first."""
    left = a.time_left()
    if left is None:
        return timeout_s
    left += DEADLINE_GRACE_S
    return left if timeout_s is None else min(timeout_s, left)


_UNWELL_CODES = {"worker_bad_stream", "worker_bad_response", "worker_empty_stream", "worker_event_too_large",
                 "worker_answer_too_large"}


def _bad_answer(message: str, code: str) -> errors.APIError:
    return errors.APIError(502, message, "server_error", code=code)


def _check_chunk(chunk: dict, chat: bool) -> None:
    if why := chunk_problem(chunk, chat):
        raise _bad_answer(f"The cloud worker's stream broke: a chunk with {why}.", "worker_bad_stream")
