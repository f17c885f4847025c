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
from cascade.web.caller import CallerGone, while_connected

log = logging.getLogger(__name__)


async def openai_response(request: Request, events: AsyncIterator, fmt, stream: bool, include_usage: bool,
                          count: Callable[[str], None]):
    """Answer from a stream of generation events (``TokenEvent``s then a ``Finish``): as SSE
    when ``stream``, else as one JSON body. A client that goes away stops the generation: the
    stream is closed (streaming) or the collecting task cancelled (not streaming). ``count`` is
    called once with the final status ("200", "499" gone, "500" failed mid-stream).

    A stream starts when its first event exists, as vLLM's does: the role chunk goes out with the
    first token, so a client's time to first byte is its time to first token, and a refusal before
    it (a 429 for a target it would miss, a 503) is a plain HTTP error, not an in-band one."""
    if stream:
        try:
            first = await while_connected(request, anext(events))
        except CallerGone:
            await events.aclose()
            count("499")
            return Response(status_code=499)
        except errors.APIError as e:
            await events.aclose()
            count(str(e.status))
            raise
        except BaseException:
            await events.aclose()
            raise
        return StreamingResponse(_sse(first, events, fmt, include_usage, count), media_type="text/event-stream",
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


async def _sse(first, events: AsyncIterator, fmt, include_usage: bool, count: Callable[[str], None]):
    status = "200"
    try:
        if (role := fmt.first_chunk()) is not None:
            yield role
        for chunk in _chunks(first, fmt, include_usage):
            yield chunk
        async for ev in events:
            for chunk in _chunks(ev, fmt, include_usage):
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


def _chunks(ev, fmt, include_usage: bool) -> list[str]:
    if isinstance(ev, Finish):
        return fmt.final_chunks(ev, include_usage)
    chunk = fmt.token_chunk(ev)
    return [] if chunk is None else [chunk]
