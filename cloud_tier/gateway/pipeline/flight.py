"""A gateway request's flight (what it holds, settled once) and the event streams it is served
from: recorded while it runs, run to its end when it has an Idempotency-Key, replayed from a
stored result."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from cascade import errors
from cascade.generation import Finish, TokenEvent, event_from_wire, event_to_wire
from cloud_tier.gateway.foreign.answers import CHARS_PER_TOKEN, answer_chars, usage_of
from cloud_tier.gateway.tenants.keys import ApiKey
from cloud_tier.gateway.workers.admission import Ticket
from cloud_tier.gateway.workers.usage import UNBOUNDED, UsageBounds, checked

log = logging.getLogger(__name__)


@dataclass
class Flight:
    """One admitted request's commitments and timings, settled once in ``close``."""

    tenant: str
    key: ApiKey
    endpoint: str
    arrived: float
    predicted_tokens: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0  # token events received so far
    answer_chars: int = 0  # an OpenAI-compatible worker's answer: the characters of its text so far
    bounds: UsageBounds = UNBOUNDED  # the most a worker may say this request used (``workers.usage``)
    usage_problem: str = ""  # why the worker's usage was refused or clamped ("": it was not)
    ticket: Ticket | None = None
    cache_key: str | None = None
    idem_key: str | None = None
    idem_owner: str | None = None  # our claim's owner token while we hold it
    heartbeat: asyncio.Task | None = None  # renews that claim's lease while the flight runs
    events: list[dict] = field(default_factory=list)
    finish: Finish | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    error: Exception | None = None  # why the stream failed (the worker, not the client); None: it did not
    settled: bool = False
    ended: bool = False  # its event stream ran to its end
    openai: str | None = None  # an OpenAI-compatible worker's answer: "chunks" (a stream) or "body"
    model: str = ""  # the model asked for, when the pool serves several
    priority_class: str = "interactive"  # cascade.protocol.PRIORITY_CLASSES
    deadline_s: float | None = None  # X-Cascade-Deadline: seconds left at arrival


def observe_event(f: Flight, ev):
    """What our workers' events tell a flight: tokens, their times, the finish (its usage checked
    against the flight's bounds: what is passed on, stored and charged). The event to pass on."""
    if isinstance(ev, TokenEvent):
        f.generated_tokens += 1
        f.last_token_at = time.perf_counter()
        if f.first_token_at is None:
            f.first_token_at = f.last_token_at
    elif isinstance(ev, Finish):
        usage, problem = checked(ev.prompt_tokens, ev.completion_tokens, f.bounds)
        f.usage_problem = problem or f.usage_problem
        prompt, completion = usage or (f.prompt_tokens, f.generated_tokens)
        if (prompt, completion) != (ev.prompt_tokens, ev.completion_tokens) or not 0 <= ev.cached_tokens <= prompt:
            ev = dataclasses.replace(ev, prompt_tokens=prompt, completion_tokens=completion,
                                     cached_tokens=min(max(0, ev.cached_tokens), prompt))
        f.finish = ev
    f.events.append(event_to_wire(ev))
    return ev


def observe_chunk(f: Flight, chunk: dict) -> dict:
    """What an OpenAI-compatible worker's chunks (or its one body) tell a flight: a chunk with
    text counts as a token until the worker's usage, which ends the flight, says how many. A usage
    refused or clamped (``workers.usage``) is replaced in the chunk by the numbers charged."""
    f.events.append(chunk)
    chars = answer_chars(chunk)
    if chars:
        f.answer_chars += chars
        f.generated_tokens += 1
        f.last_token_at = time.perf_counter()
        if f.first_token_at is None:
            f.first_token_at = f.last_token_at
    usage = usage_of(chunk)
    if usage is None and f.openai == "body":  # a whole answer without usage: ours, estimated, in its place
        usage = estimated_usage(f)
        chunk["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}
    if usage is not None:
        reasons = [ch.get("finish_reason") for ev in f.events for ch in (ev.get("choices") or ())
                   if isinstance(ch, dict) and isinstance(ch.get("finish_reason"), str)]
        checked_usage, f.usage_problem = checked(*usage, f.bounds)
        prompt, completion = checked_usage or estimated_usage(f)
        if f.usage_problem:
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}
        f.finish = Finish(reasons[-1] if reasons else "stop", prompt, completion)
    return chunk


def estimated_usage(f: Flight) -> tuple[int, int]:
    """A foreign answer's usage when its worker gives none (or one refused): the prompt's estimate,
    and the answer's (its characters, or the chunks with text where those are more)."""
    completion = max(f.generated_tokens, f.answer_chars // CHARS_PER_TOKEN, 1) if f.answer_chars else 0
    return f.prompt_tokens, min(completion, f.bounds.completion)


class Recorder:
    """Wraps a flight's event stream: records the events for the cache and idempotency store
    (``observe``: our workers' events or OpenAI chunks), and settles the flight when closed (read
    to the end, failed, or abandoned by the client)."""

    def __init__(self, events: AsyncIterator, flight: Flight, settle: Callable[[Flight], None],
                 observe: Callable[[Flight, object], object] = observe_event):
        self._events = events
        self.flight = flight
        self._settle = settle
        self._observe = observe

    def __aiter__(self):
        return self

    async def __anext__(self):
        f = self.flight
        try:
            ev = await self._events.__anext__()
        except StopAsyncIteration:
            f.ended = True
            raise
        except asyncio.CancelledError:
            raise  # the client is gone: not a failure of the stream
        except Exception as e:
            f.error = e
            raise
        try:
            return self._observe(f, ev)
        except Exception as e:  # what the worker sent made no sense: its failure, not the client's
            f.error = e
            raise

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


class FirstPulled:
    """An event stream whose first event was read already (to choose the HTTP status)."""

    def __init__(self, first, events):
        self._first = [first]
        self._events = events

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._first:
            return self._first.pop()
        return await self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()


async def pull_first(events, is_disconnected: Callable[[], Awaitable[bool]], poll_s: float = 0.25):
    """Read the first event of ``events`` before a response is chosen: a failure before it raises
    (so that it becomes the HTTP status); a client that leaves meanwhile gives None. Either way
    ``events`` is closed then; otherwise it goes on, first event included, in what is returned."""
    first = asyncio.ensure_future(events.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({first}, timeout=poll_s)
            if done:
                return FirstPulled(first.result(), events)
            if await is_disconnected():
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
                await events.aclose()
                return None
    except BaseException:
        if not first.done():
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
        await events.aclose()
        raise


async def replay(stored: dict) -> AsyncIterator[TokenEvent | Finish]:
    for data in stored["events"]:
        yield event_from_wire(data)


def render_stored(stored: dict, fmt) -> bytes:
    """A stored result as a non-streamed body: rendered once, as a template that only a fresh id
    and time go into (the same bytes as dumping the response with them, at under half the cost)."""
    template = stored.get("json_template")
    if template is None:
        events = [event_from_wire(e) for e in stored["events"]]
        body = fmt.response(events[:-1], events[-1]).model_dump(exclude_none=True)
        template = stored["json_template"] = _template({**body, "id": None, "created": None})
    return (template % {"id": json.dumps(fmt.id), "created": json.dumps(fmt.created)}).encode()


def _template(body: dict) -> str:
    """``body`` as compact JSON with %(id)s and %(created)s in place of those two values."""
    items = [f"{json.dumps(k)}:%({k})s" if k in ("id", "created") else
             f"{json.dumps(k)}:{json.dumps(v, separators=(',', ':'))}".replace("%", "%%") for k, v in body.items()]
    return "{" + ",".join(items) + "}"


async def replay_chunks(chunks: list[dict]) -> AsyncIterator[dict]:
    for c in chunks:
        yield c


async def first_of(events) -> dict:
    """The one item of a stream that has one (a worker's JSON body), read to the stream's end (so
    that the flight counts as answered), the stream closed after."""
    items = []
    try:
        async for item in events:
            items.append(item)
    finally:
        await events.aclose()
    if not items:
        raise errors.APIError(502, "The cloud worker gave no answer.", "server_error", code="worker_failed")
    return items[0]


async def relay_sse(chunks, include_usage: bool) -> AsyncIterator[str]:
    """OpenAI chunks as SSE, unchanged but for the usage the gateway asked for on the client's
    behalf (its chunk and ``usage: null`` fields are left out for a client that did not); a
    failure after the first byte goes in-band, and the stream always ends with [DONE]."""
    try:
        async for chunk in chunks:
            if not include_usage and "usage" in chunk:
                if not chunk.get("choices"):
                    continue
                chunk = {k: v for k, v in chunk.items() if k != "usage"}
            yield f"data: {json.dumps(chunk, separators=(',', ':'), ensure_ascii=False)}\n\n"
    except asyncio.CancelledError:
        raise
    except errors.APIError as e:
        yield e.sse()
    except Exception as e:
        log.exception("relaying a worker's stream failed")
        yield errors.APIError(502, f"relaying the stream failed: {e}", "server_error", code="worker_failed").sse()
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except Exception:  # settling is exception-safe on its own; the stream still ends
                log.exception("closing a worker's stream failed")
    yield "data: [DONE]\n\n"
