"""Reading an OpenAI-style SSE stream (``data: {...}`` events, ended by ``data: [DONE]``) from a
peer that may be hostile: the edge agent's reader of the cloud's answer.

The stream's bytes are split into lines on b"\\n" only (SSE's line ends; never on the U+2028,
U+0085 or form feed that ``str.splitlines`` and httpx's ``aiter_lines`` also break at, which may
sit raw inside a token's text), no line longer than ``max_line_bytes`` is ever held (one is a
BrokenStream as soon as it gets there), and each event is decoded by the strict decoder
(``cascade.wire``: no NaN, no infinity, no lone surrogate)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from cascade import wire

MAX_EVENT_BYTES = 1 << 20  # one SSE line (a chunk of one token, or a few, is well under 1 KB)


class BrokenStream(Exception):
    """The stream was not a well-formed OpenAI stream: a chunk that is not a JSON object, an
    in-band error (``error`` set to its message), a line over its bound, or an end without ``[DONE]``."""

    def __init__(self, message: str, error: object = None):
        super().__init__(message)
        self.error = error  # the in-band error event's body, if that is what it was


async def lines(chunks: AsyncIterator[bytes], max_line_bytes: int = MAX_EVENT_BYTES,
                too_long: Callable[[int], Exception] | None = None) -> AsyncIterator[bytes]:
    """The lines of a byte stream, without their b"\\n" (nor a b"\\r" before it); the last one even
    without a b"\\n". As soon as a line passes ``max_line_bytes``: ``too_long(max_line_bytes)``
    raised (default a BrokenStream)."""
    too_long = too_long or _too_long
    buf = bytearray()
    async for data in chunks:
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            if len(buf) + end - start > max_line_bytes:
                raise too_long(max_line_bytes)
            buf += data[start:end]
            yield bytes(buf[:-1] if buf.endswith(b"\r") else buf)
            buf.clear()
            start = end + 1
        buf += data[start:]
        if len(buf) > max_line_bytes:
            raise too_long(max_line_bytes)
    if buf:
        yield bytes(buf)


def _too_long(limit: int) -> BrokenStream:
    return BrokenStream(f"an event over {limit} bytes")


async def next_chunk(stream: AsyncIterator[bytes], limit: int = MAX_EVENT_BYTES) -> dict | None:
    """The next chunk of an OpenAI stream (``stream``: its ``lines``); None at ``[DONE]``;
    BrokenStream otherwise."""
    async for line in stream:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip(b" \t\r")
        if data == b"[DONE]":
            return None
        try:
            chunk = wire.loads(data, limit=limit)
        except wire.WireError as e:
            raise BrokenStream(f"unreadable chunk ({e.reason}): {data[:100]!r}") from None
        if not isinstance(chunk, dict):
            raise BrokenStream(f"a chunk that is not an object: {data[:100]!r}")
        if "error" in chunk or chunk.get("object") == "error":
            err = chunk["error"] if "error" in chunk else chunk
            message = (err.get("message") if isinstance(err, dict) else None) or str(err)[:200]
            raise BrokenStream(str(message)[:500], err)
        return chunk
    raise BrokenStream("the stream was cut (no [DONE])")
