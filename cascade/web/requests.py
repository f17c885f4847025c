"""Reading a request: the bearer key, the JSON body (bounded), and its validation."""

from __future__ import annotations

import hmac
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from cascade import errors, wire

T = TypeVar("T", bound=BaseModel)
BODY_MAX_DEPTH = 100  # a request body: a JSON schema or a tool's parameters nest, but not this deep


def require_api_key(request: Request) -> None:
    """A FastAPI dependency: when the app's ``config.server.api_key`` is set, the request must
    carry ``Authorization: Bearer <key>`` (compared in constant time), else 401."""
    expected = request.app.state.config.server.api_key
    if expected and not bearer_matches(request, expected):
        raise errors.unauthorized()


def bearer_matches(request: Request, expected: str) -> bool:
    """Whether the request carries ``Authorization: Bearer <expected>`` (constant-time compare)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected.encode())


async def read_json(request: Request, limit: int) -> dict:
    """The request body as a JSON object, by the one strict decoder (cascade/wire.py): 413 past
    ``limit`` bytes (counted while it arrives), 400 for bad UTF-8, a lone surrogate, bad JSON,
    NaN/Infinity, a number beyond a float or an integer beyond 64 bits."""
    body = await read_body(request, limit)
    try:
        # integers of any size pass here: the request's schema refuses one out of range naming its parameter
        data = wire.loads(body, limit=limit, max_depth=BODY_MAX_DEPTH, int64=False)
    except wire.WireError as e:
        if e.reason == "too_large":
            raise _too_large(limit) from e
        if e.reason == "encoding":
            raise errors.bad_request("The request body is not valid UTF-8.", None, "invalid_encoding") from e
        if e.reason == "surrogate":
            raise errors.bad_request("The request body has a string with a lone UTF-16 surrogate "
                                     "(an unpaired \\ud800-\\udfff escape).", None, "invalid_encoding") from e
        if str(e).startswith("nested"):
            raise errors.bad_request("The request body is nested too deeply.", None, "invalid_json") from e
        raise errors.bad_request(f"The request body is not valid JSON: {e}.", None, "invalid_json") from e
    if not isinstance(data, dict):
        raise errors.bad_request("The request body must be a JSON object.", None, "invalid_json")
    return data


async def read_body(request: Request, limit: int) -> bytes:
    """The request body's bytes, bounded while they arrive: 413 past ``limit`` (a declared
    Content-Length over it is refused before a byte is read)."""
    declared = request.headers.get("content-length")
    if declared and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _too_large(limit: int) -> errors.APIError:
    return errors.APIError(413, f"The request body exceeds {limit} bytes.", "invalid_request_error",
                           None, "request_too_large")


def parse_body(model: type[T], data: dict) -> T:
    """Validate ``data`` as ``model``; a failure is a 400 naming the first bad parameter."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise errors.validation_error(e.errors()) from e
