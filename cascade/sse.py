"""Reading an OpenAI-style SSE stream (``data: {...}`` events, ended by ``data: [DONE]``): the
one parser for both ends that consume one, the edge agent (the cloud's answer) and the gateway (a
foreign worker's)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator


class BrokenStream(Exception):
    """The stream was not a well-formed OpenAI stream: a chunk that is not a JSON object, an
    in-band error (``error`` set to its message), or an end without ``[DONE]``."""

    def __init__(self, message: str, error: object = None):
        super().__init__(message)
        self.error = error  # the in-band error event's body, if that is what it was


async def next_chunk(lines: AsyncIterator[str]) -> dict | None:
    """The next chunk of an OpenAI stream; None at ``[DONE]``; BrokenStream otherwise."""
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return None
        try:
            chunk = json.loads(data)
        except ValueError:
            raise BrokenStream(f"unreadable chunk: {data[:100]!r}") from None
        if not isinstance(chunk, dict):
            raise BrokenStream(f"a chunk that is not an object: {data[:100]!r}")
        if "error" in chunk or chunk.get("object") == "error":
            err = chunk["error"] if "error" in chunk else chunk
            message = (err.get("message") if isinstance(err, dict) else None) or str(err)[:200]
            raise BrokenStream(str(message)[:500], err)
        return chunk
    raise BrokenStream("the stream was cut (no [DONE])")
