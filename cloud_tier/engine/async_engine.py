"""The engine for servers: one background thread steps the engine; callers on an asyncio loop
add requests and read each one's outputs as an async stream."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence

from cloud_tier.engine.draft import Draft
from cloud_tier.engine.llm_engine import LLMEngine
from cloud_tier.engine.outputs import RequestOutput
from cloud_tier.engine.request import Request, ServiceLevel
from cloud_tier.engine.scheduling.admission import SLOMissError
from cloud_tier.sampling import SamplingParams

log = logging.getLogger(__name__)

# The GIL switch interval while an engine thread runs (CASCADE_ENGINE_SWITCH_INTERVAL_US, default
# 200 us; Python's own is 5 ms). The engine thread takes the GIL back after each of a step's ~360
# kernels; while the server's event loop thread runs Python (streaming to its clients), each of
# those may wait out the interval. A 3072x576 bf16 GEMM run 50 times beside a thread running Python:
# 883 ms at 5 ms, 251 at 200 us; a 2-core worker serving 100 streams: 1-16% less TPOT (4 of 4 pairs).
SWITCH_INTERVAL_US = 200


def engine_switch_interval_s() -> float:
    raw = os.environ.get("CASCADE_ENGINE_SWITCH_INTERVAL_US", "")
    try:
        us = float(raw) if raw.strip() else SWITCH_INTERVAL_US
        if math.isnan(us):
            raise ValueError(raw)
    except ValueError:
        log.warning("CASCADE_ENGINE_SWITCH_INTERVAL_US=%r is not a number; using %d", raw, SWITCH_INTERVAL_US)
        us = SWITCH_INTERVAL_US
    return max(us, 1.0) / 1e6


class EngineDeadError(RuntimeError):
    """The engine thread failed; requests in flight cannot finish."""


class RequestFailedError(RuntimeError):
    """This request could not go on (the engine goes on); the message says why."""


class RequestAbortedError(RuntimeError):
    """The request was aborted while its stream was open."""


class AsyncLLMEngine:
    """Owns the engine thread. Only that thread touches the engine's scheduler and model; other
    threads talk to it through an inbox, so the engine needs no locks of its own."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self.error: BaseException | None = None
        # a shorter interval only: never lengthen what the process chose
        sys.setswitchinterval(min(sys.getswitchinterval(), engine_switch_interval_s()))
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams,
                       request_id: str | None = None, priority: int = 0,
                       slo: ServiceLevel | None = None) -> AsyncIterator[RequestOutput]:
        """Validate (ValueError before anything is queued), then stream the request's outputs.
        Stopping the iteration early aborts the request. SLOMissError (before any output) if it
        would miss its TTFT target."""
        req = self.prepare(prompt, params, request_id, priority, slo)
        async for out in self.stream(req):
            yield out

    def prepare(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None,
                priority: int = 0, slo: ServiceLevel | None = None, arrival_time: float | None = None,
                draft: Draft | None = None) -> Request:
        """A validated request (ValueError, also for the id of a request streaming here).
        ``arrival_time``: when it arrived (``time.monotonic()``; now if not given), where its TTFT counts from;
        ``draft``: a device's draft to verify (``LLMEngine.make_request``)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}")
        if request_id is not None and request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}: a request with this id is in flight")
        return self.engine.make_request(prompt, params, request_id, priority, arrival_time, slo, draft)

    async def stream(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Queue ``req`` and stream its outputs (ValueError if the engine refuses it, e.g. a
        duplicate id; nothing else is touched then)."""
        queue = self._open(req.request_id)
        self._send("add", req)
        async for out in self._iterate(req, queue):
            yield out

    async def adopt(self, req: Request, kv, logprobs=None, sampler_state: bytes | None = None,
                    num_cached_tokens: int = 0) -> AsyncIterator[RequestOutput]:
        """Take over a request prefilled elsewhere (see ``LLMEngine.adopt``); returns its stream
        once its KV is in this engine's cache, so the caller may release the source's copy.
        Raises KVCapacityError or ValueError (nothing adopted). A caller that does not read the
        stream to its end closes it or aborts the request."""
        queue = self._open(req.request_id)
        try:
            await self.call(lambda e: self._adopt_on_engine(e, req, kv, logprobs, sampler_state,
                                                            num_cached_tokens))
        except BaseException as e:
            self._forget_stream(req.request_id, queue)
            if isinstance(e, asyncio.CancelledError):  # the call still runs: undo it if it adopted
                self._send("abort_request", req)
            raise
        return self._iterate(req, queue)

    def _adopt_on_engine(self, engine: LLMEngine, req, kv, logprobs, sampler_state, num_cached) -> None:
        out = engine.adopt(req, kv, logprobs, sampler_state, num_cached)
        self._deliver(req.request_id, _snapshot(out))

    async def call(self, fn):
        """Run ``fn(engine)`` on the engine thread between steps; its result (or exception)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._send("call", (fn, loop, future))
        return await future

    def _open(self, request_id: str) -> asyncio.Queue:
        if request_id in self._streams:  # its outputs would go to the new caller, the first would hang
            raise ValueError(f"duplicate request id {request_id!r}: a request with this id is in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        return queue

    def _forget_stream(self, request_id: str, queue: asyncio.Queue) -> None:
        """Drop this stream's entry (not a later stream's that reuses the id). On the loop's thread."""
        target = self._streams.get(request_id)
        if target is not None and target[1] is queue:
            del self._streams[request_id]

    async def _iterate(self, req: Request, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine ended it, or never took it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._forget_stream(req.request_id, queue)
            if not finished:
                self._send("abort_request", req)  # this request, not another that has its id

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)

    def stats(self) -> dict:
        return self.engine.stats()

    # -- engine thread -------------------------------------------------------------------

    def _send(self, kind: str, payload: object) -> None:
        self._inbox.append((kind, payload))
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """Hand ``item`` to the request's stream; the last item (finished, or an error) also
        ends the stream's entry, whether or not anyone reads it."""
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """``_deliver`` for a step's outputs: one wake-up of each event loop for all of them (a
        call_soon_threadsafe per output wrote to the loop's self-pipe 100 times a step at 100 streams)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                loop, queue = target
                by_loop.setdefault(loop, []).append((request_id, queue, item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(self._hand_over, batch)

    def _hand_over(self, batch: list[tuple[str, asyncio.Queue, RequestOutput | BaseException]]) -> None:
        """On the loop's thread: each item into its stream's queue, in order."""
        for request_id, queue, item in batch:
            queue.put_nowait(item)
            if isinstance(item, BaseException) or item.finished:
                self._forget_stream(request_id, queue)

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                try:
                    self.engine.add(payload)
                except Exception as e:  # this request is refused; the engine goes on
                    self._deliver(payload.request_id, e)
            elif kind == "call":
                fn, loop, future = payload
                try:
                    result = fn(self.engine)
                except Exception as e:  # the caller gets it; the engine goes on
                    loop.call_soon_threadsafe(_settle, future, None, e)
                else:
                    loop.call_soon_threadsafe(_settle, future, result, None)
            elif kind == "abort_request":
                if self.engine.abort_request(payload):
                    self._deliver(payload.request_id, RequestAbortedError(f"request {payload.request_id!r} aborted"))
            else:
                self.engine.abort(payload)
                self._deliver(payload, RequestAbortedError(f"request {payload!r} aborted"))

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                self._deliver_all([(out.request_id, _item(out)) for out in self.engine.step()])
                if self.engine.stalled:  # nothing can run until a held KV is released: no busy loop
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # every waiting stream and call learns of it; nothing hangs
            log.exception("engine loop failed")
            self.error = e
            self._deliver_all([(rid, EngineDeadError(f"the engine stopped: {e}")) for rid in list(self._streams)])
            while self._inbox:
                kind, payload = self._inbox.popleft()
                if kind == "call":
                    _, loop, future = payload
                    loop.call_soon_threadsafe(_settle, future, None, EngineDeadError(f"the engine stopped: {e}"))


def _item(out: RequestOutput) -> RequestOutput | BaseException:
    """What a request's stream gets for ``out``: a copy of it, or the error that ended it."""
    if out.retry_after_s is not None:
        return SLOMissError(f"request {out.request_id!r} refused: {out.error}", out.retry_after_s)
    if out.error is not None:
        return RequestFailedError(out.error)
    return _snapshot(out)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():  # the caller gave up waiting
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy another thread may read while the engine keeps appending to the original."""
    return dataclasses.replace(out, token_ids=list(out.token_ids), new_token_ids=list(out.new_token_ids),
                               logprobs=None if out.logprobs is None else list(out.logprobs),
                               new_logprobs=list(out.new_logprobs))
