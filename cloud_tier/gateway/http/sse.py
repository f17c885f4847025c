"""A pipeline's event stream on its way out over HTTP: its first event read before the status is
chosen (``pull_first``), a foreign worker's chunks relayed as SSE (``relay_sse``)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from fastapi.responses import StreamingResponse

from cascade import errors

log = logging.getLogger(__name__)


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


async def relay_sse(chunks, include_usage: bool) -> AsyncIterator[bytes]:
    """OpenAI chunks as SSE: a worker's chunk (chunk, its bytes) as the bytes it came in, unless
    the usage the gateway asked for on the client's behalf is to be left out (its chunk, and a
    ``usage`` field, for a client that did not ask) or the chunk was changed (a dict: written
    again); a failure after the first byte goes in-band, and the stream always ends with [DONE].
    A chunk with neither text nor a finish (the role-only first one, the usage one last) is
    passed on with the chunk after it (or with [DONE]: the stream's end, as a ``Last``): one write
    to the client's socket instead of two, and that write is most of a relayed chunk's cost."""
    held = b""
    try:
        async for item in chunks:
            if type(item) is tuple:
                chunk, raw = item
                if include_usage or "usage" not in chunk:
                    out = b"data: " + raw + b"\n\n"
                else:
                    out = _without_usage(chunk)
            else:
                chunk = item
                out = _without_usage(chunk) if not include_usage and "usage" in chunk else (
                    b"data: " + dumps(chunk) + b"\n\n")
            if _carries_nothing(chunk):
                held += out
                continue
            yield held + out
            held = b""
    except asyncio.CancelledError:
        raise
    except errors.APIError as e:
        held += e.sse().encode()
    except Exception as e:
        log.exception("relaying a worker's stream failed")
        held += errors.APIError(502, f"relaying the stream failed: {e}", "server_error", code="worker_failed"
                                ).sse().encode()
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except Exception:  # settling is exception-safe on its own; the stream still ends
                log.exception("closing a worker's stream failed")
    yield Last(held + b"data: [DONE]\n\n")


class Last(bytes):
    """The stream's last bytes: ``RelayResponse`` sends them with the response's end."""


def _carries_nothing(chunk: dict) -> bool:
    """No text and no finish in it: a role-only chunk, a usage chunk (a client waits for neither)."""
    for c in chunk.get("choices") or ():
        if type(c) is not dict or c.get("finish_reason") is not None or c.get("text"):
            return False
        delta = c.get("delta")
        if type(delta) is dict and (delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")
                                    or delta.get("refusal")):
            return False
    return True


def _without_usage(chunk: dict) -> bytes:
    """The chunk for a client that did not ask for usage: none (a usage-only chunk), or it without its ``usage``."""
    if not chunk.get("choices"):
        return b""
    return b"data: " + dumps({k: v for k, v in chunk.items() if k != "usage"}) + b"\n\n"


class RelayResponse(StreamingResponse):
    """A StreamingResponse whose last part (``Last``) goes with the end of the body: one write."""

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = b""
        async for chunk in self.body_iterator:
            if type(chunk) is Last:
                last = bytes(chunk)
            elif chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": last, "more_body": False})


def dumps(chunk: dict) -> bytes:
    """A chunk as compact JSON (orjson; ``json`` for what orjson does not write: an integer past 64
    bits, which a worker may send and the strict decoder keeps)."""
    try:
        return orjson.dumps(chunk)
    except TypeError:
        return json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode()
