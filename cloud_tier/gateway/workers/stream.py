"""Reading a worker's answer, bounded while it is read: its lines (split on b"\\n" only, so a
U+2028 inside a chunk's text stays in it; no line longer than ``max_line_bytes`` is ever held),
the chunks of an OpenAI SSE stream, a whole body (up to ``limit`` bytes), each decoded by the
strict decoder (``cascade.wire``). Whatever breaks the rules is a 502 APIError naming why; a
worker's refusal becomes the gateway's answer in ``error_of`` (both kinds of worker)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import httpx

from cascade import errors, wire


def _bad(message: str, code: str = "worker_bad_stream") -> errors.APIError:
    return errors.APIError(502, message, "server_error", code=code)


def _too_large(limit: int) -> errors.APIError:
    return _bad(f"The cloud worker sent an event over {limit} bytes.", "worker_event_too_large")


def decode(data: bytes, limit: int, what: str) -> object:
    """``data`` as JSON by the strict decoder; integers of any size are kept (a worker's usage is
    clamped where it is read, ``workers.usage``), NaN and the like refused."""
    try:
        return wire.loads(data, limit=limit, int64=False)
    except wire.WireError as e:
        raise _bad(f"The cloud worker sent {what} that is not JSON ({e.reason}): {str(e)[:120]}") from None


def _checked_chunk(data: bytes, limit: int) -> dict:
    """One event's data as a chunk: a JSON object with a list of choices, not an in-band error."""
    chunk = decode(data, limit, "a chunk")
    if not isinstance(chunk, dict) or not isinstance(chunk.get("choices", []), list):
        raise _bad(f"The cloud worker's stream broke: a chunk that is not one: {data[:100]!r}")
    if "error" in chunk or chunk.get("object") == "error":
        err = chunk["error"] if "error" in chunk else chunk
        message = (err.get("message") if isinstance(err, dict) else None) or str(err)[:200]
        raise _bad(f"The cloud worker's stream broke: {str(message)[:500]}", "worker_error")
    return chunk


class LineReader:
    """The lines of a byte stream whose bytes come from ``read`` (b"" at the end): split on b"\\n"
    only (never on the U+2028 or form feed ``str.splitlines`` knows, which may sit raw in a token's
    text), a "\\r" before it dropped, bounded (a 502 as soon as one passes ``max_line_bytes``), the last one
    even without its b"\\n"; ``line()`` is None at the end. One object, no generator per line:
    the relay's hot loop (our workers' NDJSON events; a foreign worker's SSE in ``ChunkReader``)."""

    def __init__(self, read: Callable[[], Awaitable[bytes]], max_line_bytes: int):
        self._read = read
        self._limit = max_line_bytes
        self._buf = bytearray()
        self._pos = 0  # where the next line starts
        self._scan = 0  # where to look for its end: the bytes before hold none (a dripped line is searched once)
        self._eof = False
        self._idle_s: float | None = None  # a ChunkReader's bound on the time between chunks
        self._last = time.monotonic()

    async def line(self) -> bytes | None:
        buf = self._buf
        while True:
            end = buf.find(b"\n", self._scan)
            if end >= 0:
                line = bytes(buf[self._pos:end])
                self._pos = self._scan = end + 1
                if len(line) > self._limit:
                    raise _too_large(self._limit)
                return line[:-1] if line.endswith(b"\r") else line
            if len(buf) - self._pos > self._limit:
                raise _too_large(self._limit)
            if self._eof:
                rest = bytes(buf[self._pos:])
                buf.clear()
                self._pos = self._scan = 0
                return rest or None
            if self._idle_s is not None and time.monotonic() - self._last > self._idle_s:
                raise TimeoutError(f"no whole chunk for {self._idle_s:g} s")  # bytes dripped into one line
            if self._pos:  # the lines read are dropped (a bytearray drops its front in place)
                del buf[:self._pos]
                self._pos = 0
            self._scan = len(buf)
            data = await self._read()
            buf += data
            self._eof = not data


class ChunkReader(LineReader):
    """The chunks of an OpenAI SSE stream, each as (the chunk, its data's bytes as the worker
    wrote them: what is relayed when nothing in it changes); ``next()`` is None at [DONE], and a
    502 for a chunk that is not a JSON object, an in-band error, or an end without [DONE]. Lines
    that are no chunk (comments, other fields, blank ones), or a line dripped a byte at a time,
    keep a stream open only ``idle_s`` past its last chunk (TimeoutError): a worker's pings alone
    never hold a stream forever."""

    def __init__(self, read: Callable[[], Awaitable[bytes]], max_event_bytes: int, idle_s: float | None = None):
        super().__init__(read, max_event_bytes)
        self._idle_s = idle_s

    async def next(self) -> tuple[dict, bytes] | None:
        while (line := await self.line()) is not None:
            if not line.startswith(b"data:"):
                if self._idle_s is not None and time.monotonic() - self._last > self._idle_s:
                    raise TimeoutError(f"no chunk for {self._idle_s:g} s, only lines that are none")
                continue
            self._last = time.monotonic()
            data = line[5:].strip()
            if data == b"[DONE]":
                return None
            return _checked_chunk(data, self._limit), data
        raise _bad("The cloud worker's stream broke: the stream was cut (no [DONE])")


async def read_all(headers, read: Callable[[], Awaitable[bytes]], limit: int) -> bytes:
    """A whole body from ``read`` (b"" or StopAsyncIteration at its end), refused (502) as soon as it
    passes ``limit`` bytes, or at once when its Content-Length says it will."""
    if (declared := headers.get("content-length", "")).isascii() and declared.isdigit() and int(declared) > limit:
        raise _bad(f"The cloud worker's answer is over {limit} bytes.", "worker_answer_too_large")
    body = bytearray()
    while True:
        try:
            data = await read()
        except StopAsyncIteration:
            break
        if not data:
            break
        body += data
        if len(body) > limit:
            raise _bad(f"The cloud worker's answer is over {limit} bytes.", "worker_answer_too_large")
    return bytes(body)


def error_of(content: bytes, status: int, headers: httpx.Headers | dict) -> errors.APIError:
    """A worker's refusal as the gateway's answer: a 4xx is the request's fault and passes through
    as it is (but a 401/403: that refuses the gateway's own credentials, a 502 to the client; a 429
    is always a ``rate_limit_error``); a 5xx is a server error, a 502 but for 503 and 504 (the
    gateway answers 500 only for its own bugs), 503 and 429 with the worker's Retry-After (else 1 s)."""
    try:
        e = wire.loads(content, limit=max(len(content), 1))["error"]
        message, code = str(e.get("message", ""))[:2000], str(e.get("code") or "worker_error")[:100]
    except (ValueError, KeyError, TypeError, AttributeError):
        e, message, code = {}, f"the worker answered {status}", "worker_error"
    if status in (401, 403):
        return errors.APIError(502, f"The cloud worker refused the gateway ({status}: {message}).", "server_error",
                               code="worker_refused_gateway")
    if status == 429:  # the worker's load, not the request's fault: the type a client backs off on
        return errors.APIError(429, message, "rate_limit_error", None, code, _retry_after(status, headers))
    if 400 <= status < 500:
        kind = e.get("type") if isinstance(e.get("type"), str) else "invalid_request_error"
        param = e.get("param") if isinstance(e.get("param"), str) else None
        return errors.APIError(status, message, kind, param, code, _retry_after(status, headers))
    if status >= 500:  # the worker's failure, never the gateway's own 500: a 502 unless it said 503/504
        out = status if status in (503, 504) else 502
        return errors.APIError(out, message, "server_error", code=code, headers=_retry_after(status, headers))
    return errors.APIError(502, f"the worker answered {status}", "server_error", code="worker_error")


def _retry_after(status: int, headers: httpx.Headers | dict) -> dict[str, str]:
    if status not in (429, 503):
        return {}
    given = headers.get("retry-after", "")
    return {"Retry-After": given if given.isascii() and given.isdigit() and 0 < int(given) <= 3600 else "1"}
