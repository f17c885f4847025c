"""Reading the cloud's answers within bounds: an error body (read this far at most), a JSON body by
the strict decoder, the content type."""

from __future__ import annotations

import httpx

from cascade import wire
from sync.delivery import openai_error

MAX_ERROR_BODY = 65536  # an error body is read this far at most (a hostile cloud's is not held whole)


async def _read_at_most(resp: httpx.Response, limit: int) -> str:
    got = bytearray()
    async for piece in resp.aiter_bytes():
        got += piece[:limit - len(got)]
        if len(got) >= limit:
            break
    return got.decode("utf-8", "replace")


def _is_error_body(text: str) -> bool:
    try:
        return openai_error(wire.loads(text, limit=MAX_ERROR_BODY))
    except ValueError:
        return False


def _content_type(r: httpx.Response) -> str:
    return r.headers.get("content-type", "no content-type").split(";")[0]


MAX_BODY_BYTES = 32 << 20  # a non-streamed answer of the cloud's (a completion, a model list)


def _json_object(r: httpx.Response) -> dict | None:
    """The body as a JSON object by the strict decoder (None when it is not one)."""
    try:
        body = wire.loads(r.content, limit=MAX_BODY_BYTES)
    except wire.WireError:
        return None
    return body if isinstance(body, dict) else None
