"""Answering from a stream of generation events: SSE or one JSON body, and what a client that
goes away stops."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cascade import errors
from cascade.generation import Finish, TokenEvent
from cascade.openai_format import DONE

log = logging.getLogger(__name__)


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
        if watcher.done() and not watcher.cancelled():  # the client left: the generation is stopped
            return Response(status_code=499)
        raise
    except errors.APIError as e:
        count(str(e.status))
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
    except errors.APIError as e:  # a refusal after the first byte (a peer's stream broke): in-band
        status = str(e.status)
        yield e.sse()
    except Exception as e:  # after the first byte, the only way to tell the client is in-band
        log.exception("generation failed mid-stream")
        status = "500"
        yield errors.APIError(500, f"generation failed: {e}", "server_error").sse()
    finally:
        await events.aclose()
        count(status)
    yield DONE
