"""Forwarding a request to an OpenAI-compatible worker (vLLM, SGLang, ours) unchanged, and
relaying its answer: the chunks of a stream (``stream_options.include_usage`` forced, so the
gateway learns the worker's real usage; the usage chunk is dropped again for a client that did
not ask for it) or its one JSON body. ``X-Request-Id`` goes to the worker and back.

Failures: a worker that cannot be reached, or answers 408, 429 or 5xx, is retried on another
worker with backoff, but only before the first byte has been passed on; a stream whose first
chunk does not come within ``first_token_timeout_s`` fails (504). Each failure counts on the
worker's circuit breaker (and a connect error takes it out of the pool until its health check
passes again), each success closes it.

vLLM prefill/decode pairs (NixlConnector): the prompt is prefilled on a prefill worker with
``max_tokens`` 1 and ``kv_transfer_params: {do_remote_decode: true}``, then decoded on a decode
worker with the ``kv_transfer_params`` the prefill returned, both under one request id; a short
prompt, or one the decode worker mostly holds already, skips the prefill, and a failed prefill
falls back to decoding alone."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx

from cascade import errors
from cascade.sse import BrokenStream, next_chunk
from cloud_tier.gateway.admission import Ticket
from cloud_tier.gateway.priority import with_vllm_priority
from cloud_tier.gateway.worker_client import _error_of
from cloud_tier.gateway.worker_pool import Worker, WorkerPool

log = logging.getLogger(__name__)

_RETRY_STATUS = {408, 429}
_NIXL_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass(frozen=True)
class ProxyConfig:
    retries: int = 2  # further attempts, before the first byte only
    retry_backoff_s: float = 0.1  # doubled per attempt, with jitter
    first_token_timeout_s: float = 60.0
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


class OpenAIProxy:
    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, config: ProxyConfig, worker_api_key: str = "",
                 rng: random.Random | None = None):
        self.pool = pool
        self.client = client
        self.config = config
        self.headers = {"content-type": "application/json"}
        if worker_api_key:
            self.headers["authorization"] = f"Bearer {worker_api_key}"
        self.rng = rng or random.Random()

    async def run(self, a: Attempt, ticket: Ticket, hit_blocks: int,
                  rechoose: Callable[[frozenset[str]], Ticket], on_ticket: Callable[[Ticket], None]
                  ) -> AsyncIterator[dict]:
        """The worker's chunks (stream) or its one body (not streamed), as dicts. ``rechoose``
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
                log.warning("worker %s: %s; retrying elsewhere (attempt %d)", worker.url, e.error.message, attempt + 1)
                await asyncio.sleep(self.config.retry_backoff_s * (2 ** attempt) * (0.5 + self.rng.random()))
                try:
                    ticket = rechoose(frozenset(tried))
                except errors.APIError:
                    try:
                        ticket = rechoose(frozenset())  # only the ones tried are left: try again
                    except errors.APIError:
                        raise e.error from None
                on_ticket(ticket)
                hit_blocks = 0

    async def _send(self, w: Worker, a: Attempt, body: dict) -> AsyncIterator[dict]:
        headers = {**self.headers, "x-request-id": a.request_id}
        request = self.client.build_request("POST", f"{w.url}{a.path}", content=json.dumps(body), headers=headers)
        resp = None
        try:
            async with asyncio.timeout(self.config.first_token_timeout_s if a.stream else None):
                resp = await self.client.send(request, stream=True)  # headers, then the first chunk, in time
                if resp.status_code != 200:
                    content = await resp.aread()
                    err = _error_of(content, resp.status_code, resp.headers)
                    if resp.status_code in _RETRY_STATUS or resp.status_code >= 500:
                        if resp.status_code >= 500:
                            self._failed(w, f"answered {resp.status_code}")
                        raise _Retryable(err)
                    self._ok(w)
                    raise err
                if not a.stream:
                    content = await resp.aread()
                    self._ok(w)
                    first = _json_body(content)
                else:
                    lines = resp.aiter_lines()
                    first = await _next_data(lines)
                    self._ok(w)
            yield first
            if a.stream:
                while (item := await _next_data(lines)) is not None:
                    yield item
        except httpx.ConnectError as e:
            self._failed(w, repr(e), down=True)
            raise _Retryable(errors.APIError(502, f"The cloud worker could not be reached: {e!r}", "server_error",
                                             code="worker_unreachable")) from e
        except (TimeoutError, httpx.TimeoutException) as e:
            self._failed(w, "no first token in time" if isinstance(e, TimeoutError) else repr(e))
            raise errors.APIError(504, "The cloud worker did not answer in time.", "server_error",
                                  code="worker_timeout") from e
        except httpx.HTTPError as e:
            self._failed(w, repr(e))
            raise errors.APIError(502, f"The cloud worker failed: {e!r}", "server_error", code="worker_failed") from e
        finally:
            if resp is not None:
                await resp.aclose()

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
            r = await self.client.post(f"{p.url}{a.path}", content=json.dumps(req),
                                       headers={**self.headers, "x-request-id": a.request_id},
                                       timeout=httpx.Timeout(self.config.first_token_timeout_s, connect=2.0))
            if r.status_code != 200:
                raise ValueError(f"answered {r.status_code}")
            params = r.json().get("kv_transfer_params")
            self._ok(p)
        except (httpx.HTTPError, ValueError) as e:
            self._failed(p, repr(e), down=isinstance(e, httpx.ConnectError))
            log.warning("prefill on %s failed (%r); decoding on %s alone", p.url, e, decode.url)
            return body
        finally:
            p.in_flight -= 1
        return {**body, "kv_transfer_params": params} if isinstance(params, dict) else body

    def _ok(self, w: Worker) -> None:
        if w.breaker is not None:
            w.breaker.success()

    def _failed(self, w: Worker, why: str, down: bool = False) -> None:
        w.last_error = why
        if w.breaker is not None:
            w.breaker.failure(why)
        if down:
            self.pool.mark_down(w.url, why)


class _Retryable(Exception):
    def __init__(self, error: errors.APIError):
        super().__init__(error.message)
        self.error = error


async def _next_data(lines: AsyncIterator[str]) -> dict | None:
    """The next chunk of the worker's stream; None at [DONE]. A broken stream or an in-band error
    is a 502."""
    try:
        return await next_chunk(lines)
    except BrokenStream as e:
        code = "worker_error" if e.error is not None else "worker_bad_stream"
        raise errors.APIError(502, f"The cloud worker's stream broke: {e}", "server_error", code=code) from None


def _json_body(content: bytes) -> dict:
    try:
        obj = json.loads(content)
    except ValueError:
        obj = None
    if not isinstance(obj, dict) or "choices" not in obj:
        raise errors.APIError(502, "The cloud worker answered something that is not a completion.", "server_error",
                              code="worker_bad_response")
    return obj
