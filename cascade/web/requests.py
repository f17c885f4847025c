"""Reading a request: the bearer key, the JSON body (bounded), and its validation."""

from __future__ import annotations

import hmac
import json
import math
import re
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from cascade import errors

T = TypeVar("T", bound=BaseModel)


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
    """The request body as a JSON object: 413 past ``limit`` bytes, 400 for bad UTF-8 or JSON."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as e:
        raise errors.bad_request("The request body is not valid UTF-8.", None, "invalid_encoding") from e
    try:
        if text.startswith("\ufeff"):  # what json.loads says of it
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        data = _DECODER.decode(text)
    except json.JSONDecodeError as e:
        raise errors.bad_request(f"The request body is not valid JSON: {e}.", None, "invalid_json") from e
    except ValueError as e:  # NaN, Infinity, or a number too large for a float
        raise errors.bad_request(f"The request body is not valid JSON: {e}.", None, "invalid_json") from e
    except RecursionError as e:  # arrays or objects nested deeper than Python's stack
        raise errors.bad_request("The request body is nested too deeply.", None, "invalid_json") from e
    if not isinstance(data, dict):
        raise errors.bad_request("The request body must be a JSON object.", None, "invalid_json")
    # a \ud800 escape decodes to a lone surrogate, which no encoder downstream will take (strict
    # UTF-8 never decodes to one, so only a body with such an escape needs the whole check)
    try:
        if _SURROGATE_ESCAPE.search(text):
            json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise errors.bad_request("The request body has a string with a lone UTF-16 surrogate "
                                 "(an unpaired \\ud800-\\udfff escape).", None, "invalid_encoding") from e
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of range")
    return value


_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)  # json.loads makes one a call
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _too_large(limit: int) -> errors.APIError:
    return errors.APIError(413, f"The request body exceeds {limit} bytes.", "invalid_request_error",
                           None, "request_too_large")


def parse_body(model: type[T], data: dict) -> T:
    """Validate ``data`` as ``model``; a failure is a 400 naming the first bad parameter."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise errors.validation_error(e.errors()) from e
