"""HTTP glue shared by our OpenAI-compatible servers (edge agent, cloud worker, gateway)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from cascade import errors
from cascade.generation import Finish, TokenEvent
from cascade.openai_format import DONE

log = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)


def require_api_key(request: Request) -> None:
    """A FastAPI dependency: when the app's ``config.server.api_key`` is set, the request must
    carry ``Authorization: Bearer <key>`` (compared in constant time), else 401."""
    expected = request.app.state.config.server.api_key
    if not expected:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise errors.unauthorized()


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
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise errors.bad_request(f"The request body is not valid JSON: {e}.", None, "invalid_json") from e
    if not isinstance(data, dict):
        raise errors.bad_request("The request body must be a JSON object.", None, "invalid_json")
    return data


def _too_large(limit: int) -> errors.APIError:
    return errors.APIError(413, f"The request body exceeds {limit} bytes.", "invalid_request_error",
                           None, "request_too_large")


def parse_body(model: type[T], data: dict) -> T:
    """Validate ``data`` as ``model``; a failure is a 400 naming the first bad parameter."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise errors.validation_error(e.errors()) from e


async def openai_response(request: Request, events: AsyncIterator, fmt, stream: bool, include_usage: bool,
                          count: Callable[[str], None]):
    """Answer from a stream of generation events (``TokenEvent``s then a ``Finish``): as SSE
    when ``stream``, else as one JSON body. A client that goes away stops the generation: the
    stream is closed (streaming) or the collecting task cancelled (not streaming). ``count`` is
    called once with the final status ("200", "499" gone, "500" failed mid-stream)."""
    if stream:
        return StreamingResponse(_sse(events, fmt, include_usage, count), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    collect = asyncio.create_task(_collect(events))
    watcher = asyncio.create_task(_watch_disconnect(request, collect))
    try:
        tokens, finish = await collect
    except asyncio.CancelledError:
        count("499")
        raise
    finally:
        watcher.cancel()
    count("200")
    return JSONResponse(fmt.response(tokens, finish).model_dump(exclude_none=True))


async def _collect(events: AsyncIterator) -> tuple[list[TokenEvent], Finish]:
    tokens: list[TokenEvent] = []
    try:
        async for ev in events:
            if isinstance(ev, Finish):
                return tokens, ev
            tokens.append(ev)
    finally:
        await events.aclose()
    raise RuntimeError("generation ended without a finish event")


async def _watch_disconnect(request: Request, task: asyncio.Task) -> None:
    while not task.done():
        await asyncio.sleep(0.25)  # first: most answers (a cache hit, a replay) never need a check
        if await request.is_disconnected():
            task.cancel()
            return


async def _sse(events: AsyncIterator, fmt, include_usage: bool, count: Callable[[str], None]):
    status = "200"
    try:
        first = fmt.first_chunk()
        if first:
            yield first
        async for ev in events:
            if isinstance(ev, Finish):
                for chunk in fmt.final_chunks(ev, include_usage):
                    yield chunk
            elif (chunk := fmt.token_chunk(ev)) is not None:
                yield chunk
    except asyncio.CancelledError:
        status = "499"  # the client went away; closing ``events`` stops the generation
        raise
    except Exception as e:  # after the first byte, the only way to tell the client is in-band
        log.exception("generation failed mid-stream")
        status = "500"
        yield errors.APIError(500, f"generation failed: {e}", "server_error").sse()
    finally:
        await events.aclose()
        count(status)
    yield DONE


def build_openai_app(title: str, lifespan, config, tier: str, *routers) -> FastAPI:
    """The shell every one of our servers shares: OpenAI error bodies, ``config`` and the start
    time on ``app.state``, the routers, and ``X-Cascade-Tier`` on every response."""
    from cascade.errors import install_error_handlers
    from cascade.tier_header import TierHeader

    app = FastAPI(title=title, lifespan=lifespan)
    app.state.config = config
    app.state.started = int(time.time())
    install_error_handlers(app)
    for r in routers:
        app.include_router(r)
    app.add_middleware(TierHeader, tier=tier)
    return app
