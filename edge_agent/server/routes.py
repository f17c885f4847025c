"""Thin HTTP handlers of the edge agent's OpenAI-compatible API."""

from __future__ import annotations

import asyncio
import hmac
import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cascade import errors
from cascade.api import parse_body, read_json
from cascade.openai_format import DONE, ChatFormatter, CompletionFormatter
from cascade.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from edge_agent.backends.base import Finish, TokenEvent
from edge_agent.server.service import EdgeService, Job

log = logging.getLogger(__name__)

TIER_HEADER = "X-Cascade-Tier"


def service(request: Request) -> EdgeService:
    return request.app.state.service


def require_api_key(request: Request) -> None:
    expected = request.app.state.config.server.api_key
    if not expected:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise errors.unauthorized()


router = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


@router.get("/healthz")
@router.get("/health")
async def healthz(request: Request):
    svc = service(request)
    return {"status": "ok", "tier": "edge", "model": svc.model_id,
            "slots": {"total": svc.pool.size, "busy": svc.pool.busy, "waiting": svc.pool.waiting}}


@router.get("/metrics")
async def metrics(request: Request):
    return PlainTextResponse(generate_latest(service(request).metrics.registry),
                             media_type=CONTENT_TYPE_LATEST)


def _model_card(request: Request) -> ModelCard:
    svc = service(request)
    d = svc.description
    return ModelCard(id=svc.model_id, created=request.app.state.started,
                     meta={"format": "gguf", "quantization": d.quantization, "n_ctx": d.n_ctx,
                           "architecture": d.architecture, "chat_template": d.chat_template})


@v1.get("/models")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_model_card(request)])


@v1.get("/models/{model:path}")
async def get_model(request: Request, model: str) -> ModelCard:
    service(request).check_model(model)
    return _model_card(request)


@v1.post("/chat/completions")
async def chat_completions(request: Request):
    svc = service(request)
    req = parse_body(ChatCompletionRequest, await read_json(request, request.app.state.config.server.max_body_bytes))
    job = svc.chat_job(req)
    fmt = ChatFormatter(svc.model_id, req.logprobs)
    return await _respond(request, svc, job, fmt, "chat", req.stream, req.include_usage_in_stream())


@v1.post("/completions")
async def completions(request: Request):
    svc = service(request)
    req = parse_body(CompletionRequest, await read_json(request, request.app.state.config.server.max_body_bytes))
    job = svc.completion_job(req)
    fmt = CompletionFormatter(svc.model_id, req.logprobs)
    return await _respond(request, svc, job, fmt, "completions", req.stream, req.include_usage_in_stream())


async def _respond(request: Request, svc: EdgeService, job: Job, fmt, endpoint: str, stream: bool,
                   include_usage: bool):
    reservation = svc.admit()  # 429 now, before any byte of a response is sent
    if stream:
        return StreamingResponse(_stream(svc, job, reservation, fmt, endpoint, include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
    try:
        events: list[TokenEvent] = []
        finish: Finish | None = None
        async for ev in svc.run(job, reservation):
            if isinstance(ev, Finish):
                finish = ev
            else:
                events.append(ev)
    finally:
        watcher.cancel()
    svc.metrics.requests.labels(endpoint=endpoint, status="200").inc()
    return JSONResponse(fmt.response(events, finish).model_dump(exclude_none=True))


async def _stream(svc: EdgeService, job: Job, reservation, fmt, endpoint: str, include_usage: bool):
    status = "200"
    try:
        first = fmt.first_chunk()
        if first:
            yield first
        async for ev in svc.run(job, reservation):
            if isinstance(ev, Finish):
                for chunk in fmt.final_chunks(ev, include_usage):
                    yield chunk
            elif (chunk := fmt.token_chunk(ev)) is not None:
                yield chunk
    except asyncio.CancelledError:
        status = "499"  # the client went away; generation is stopped, the slot freed
        raise
    except Exception as e:  # after the first byte, the only way to tell the client is in-band
        log.exception("generation failed mid-stream")
        status = "500"
        yield errors.APIError(500, f"generation failed: {e}", "server_error").sse()
    finally:
        svc.metrics.requests.labels(endpoint=endpoint, status=status).inc()
    yield DONE


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    while not job.cancel.is_set():
        if await request.is_disconnected():
            job.cancel.set()
            return
        await asyncio.sleep(0.25)
