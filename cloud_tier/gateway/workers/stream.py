"""Reading a worker's answer, bounded while it is read: its lines (split on b"\\n" only, so a
U+2028 inside a chunk's text stays in it; no line longer than ``max_line_bytes`` is ever held),
the chunks of an OpenAI SSE stream, a whole body (up to ``limit`` bytes), each decoded by the
strict decoder (``cascade.wire``). Whatever breaks the rules is a 502 APIError naming why; a
worker's refusal becomes the gateway's answer in ``error_of`` (both kinds of worker)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

from cascade import errors, sse, wire


def _bad(message: str, code: str = "worker_bad_stream") -> errors.APIError:
    return errors.APIError(502, message, "server_error", code=code)


def lines(chunks: AsyncIterator[bytes], max_line_bytes: int) -> AsyncIterator[bytes]:
    """The lines of a byte stream (``cascade.sse.lines``: split on b"\\n" only, the last one even
    without it); a line over ``max_line_bytes`` is a 502 as soon as it gets there."""
    return sse.lines(chunks, max_line_bytes, too_long=_too_large)


def _too_large(limit: int) -> errors.APIError:
    return _bad(f"The cloud worker sent an event over {limit} bytes.", "worker_event_too_large")


def decode(data: bytes, limit: int, what: str) -> object:
    """``data`` as JSON by the strict decoder; integers of any size are kept (a worker's usage is
    clamped where it is read, ``workers.usage``), NaN and the like refused."""
    try:
        return wire.loads(data, limit=limit, int64=False)
    except wire.WireError as e:
        raise _bad(f"The cloud worker sent {what} that is not JSON ({e.reason}): {str(e)[:120]}") from None


async def next_sse_chunk(stream: AsyncIterator[bytes], limit: int) -> dict | None:
    """The next chunk of an OpenAI stream (``stream``: its ``lines``); None at ``data: [DONE]``; a
    502 for a chunk that is not a JSON object, an in-band error, or an end without [DONE]."""
    async for line in stream:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return None
        return _checked_chunk(data, limit)
    raise _bad("The cloud worker's stream broke: the stream was cut (no [DONE])")


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


class ChunkReader:
    """The chunks of an OpenAI SSE stream whose bytes come from ``read`` (b"" at the end), each as
    (the chunk, its data's bytes as the worker wrote them: what is relayed when nothing in it
    changes). Lines split on b"\n" only and bounded as ``lines``; ``next()`` is None at [DONE]
    and a 502 as ``next_sse_chunk`` says. One object, no generator per line: the relay's hot loop."""

    def __init__(self, read: Callable[[], Awaitable[bytes]], max_event_bytes: int):
        self._read = read
        self._limit = max_event_bytes
        self._buf = b""
        self._pos = 0
        self._eof = False

    async def _line(self) -> bytes | None:
        while True:
            end = self._buf.find(b"\n", self._pos)
            if end >= 0:
                line = self._buf[self._pos:end]
                self._pos = end + 1
                if len(line) > self._limit:
                    raise _too_large(self._limit)
                return line[:-1] if line.endswith(b"\r") else line
            if len(self._buf) - self._pos > self._limit:
                raise _too_large(self._limit)
            if self._eof:
                rest, self._buf, self._pos = self._buf[self._pos:], b"", 0
                return rest or None
            data = await self._read()
            self._buf = self._buf[self._pos:] + data if self._pos < len(self._buf) else data
            self._pos = 0
            self._eof = not data

    async def next(self) -> tuple[dict, bytes] | None:
        while (line := await self._line()) is not None:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return None
            return _checked_chunk(data, self._limit), data
        raise _bad("The cloud worker's stream broke: the stream was cut (no [DONE])")


async def read_body(resp: httpx.Response, limit: int) -> bytes:
    """The whole body of ``resp``, refused (502) as soon as it passes ``limit`` bytes."""
    return await read_all(resp.headers, resp.aiter_bytes().__anext__, limit)


async def read_all(headers, read: Callable[[], Awaitable[bytes]], limit: int) -> bytes:
    """A whole body from ``read`` (b"" or StopAsyncIteration at its end), refused (502) as soon as it
    passes ``limit`` bytes, or at once when its Content-Length says it will."""
    if (declared := headers.get("content-length", "")).isdigit() and int(declared) > limit:
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
    return {"Retry-After": given if given.isdigit() and 0 < int(given) <= 3600 else "1"}
