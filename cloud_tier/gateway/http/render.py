"""A pipeline result as the HTTP response an OpenAI client expects: one function per kind of
result (``pipeline.results``). A stream's first event is read before the status is chosen, so a
failure before it is an HTTP error, not a 200 with an error inside; a client that leaves before
it gets a 499."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from cascade.web import openai_response
from cascade.web.caller import CallerGone, while_connected
from cloud_tier.gateway.http.sse import RelayResponse, pull_first, relay_sse
from cloud_tier.gateway.pipeline.results import (
    CachedAnswer,
    CachedForeignAnswer,
    ForeignStream,
    OwnStream,
    Result,
    first_of,
)


async def respond(request: Request, result: Result, endpoint: str, req, formatter) -> Response:
    """``result`` as the response to ``req`` (its ``stream`` and usage options); ``formatter``
    makes the OpenAI formatter our workers' events are rendered with."""
    match result:
        case CachedAnswer():
            return await _cached(request, result, req, formatter)
        case OwnStream():
            return await _own_stream(request, result, req, formatter)
        case CachedForeignAnswer():
            return _cached_foreign(result, endpoint, req)
        case ForeignStream():
            return await _foreign_stream(request, result, req)
    raise TypeError(f"not a pipeline result: {type(result).__name__}")


async def _cached(request: Request, result: CachedAnswer, req, formatter) -> Response:
    """A cache hit or a replay of our workers' answer: nothing to wait for."""
    fmt = formatter()
    if not req.stream:
        return Response(result.json_body(fmt), media_type="application/json", headers=result.headers)
    resp = await openai_response(request, result.events(), fmt, req.stream, req.include_usage_in_stream(),
                                 lambda _: None)
    resp.headers.update(result.headers)
    return resp


async def _own_stream(request: Request, result: OwnStream, req, formatter) -> Response:
    fmt = formatter()
    events = result.events
    if req.stream:
        events = await pull_first(events, request.is_disconnected)
        if events is None:
            return Response(status_code=499)  # the client left before the first token
    resp = await openai_response(request, events, fmt, req.stream, req.include_usage_in_stream(), lambda _: None)
    resp.headers.update(result.headers)
    return resp


def _cached_foreign(result: CachedForeignAnswer, endpoint: str, req) -> Response:
    """A foreign worker's stored answer, in the shape this request wants."""
    if not req.stream:
        return JSONResponse(result.body(endpoint), headers=result.headers)
    return RelayResponse(relay_sse(result.chunks(endpoint), req.include_usage_in_stream()),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache", **result.headers})


async def _foreign_stream(request: Request, result: ForeignStream, req) -> Response:
    """A foreign worker's answer, passed on as it comes."""
    if not req.stream:
        try:
            body = await while_connected(request, first_of(result.events))
        except CallerGone:
            return Response(status_code=499)
        return JSONResponse(body, headers=result.headers)
    events = await pull_first(result.events, request.is_disconnected)
    if events is None:
        return Response(status_code=499)  # the client left before the first chunk
    return RelayResponse(relay_sse(events, req.include_usage_in_stream()), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **result.headers})
