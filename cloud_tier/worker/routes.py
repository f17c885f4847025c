"""Thin handlers of the worker's OpenAI-compatible API."""

from __future__ import annotations

import asyncio
import json
import logging
import os

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

import cascade
from cascade import errors
from cascade.embeddings import EmbeddingRequest
from cascade.generation import event_to_wire
from cascade.openai_format import formatter_for
from cascade.protocol import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, ModelCard, ModelList
from cascade.web import openai_response, openapi, parse_body, read_json, require_api_key
from cascade.web.caller import CallerGone, while_connected
from cloud_tier.disagg.decode import PrefillFailed
from cloud_tier.disagg.protocol import GenerateRequest, PrefillRequest, PrefillResponse, ServedModel, WorkerLoadReport
from cloud_tier.engine.async_engine import EngineDeadError
from cloud_tier.worker.protocol import WorkerStats
from cloud_tier.worker.service import WorkerService

log = logging.getLogger(__name__)


def service(request: Request) -> WorkerService:
    return request.app.state.service


ops = APIRouter()  # health and metrics
v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
internal = APIRouter(prefix="/internal", dependencies=[Depends(require_api_key)])
_GENERATION_ERRORS = openapi.errors(400, 401, 404, 413, 429, 500, 503)  # 429: it would miss its TTFT target


@ops.get("/healthz", responses=openapi.errors(503))
@ops.get("/health", responses=openapi.errors(503))
async def healthz(request: Request):
    svc = service(request)
    if svc.engine.error is not None:
        raise errors.APIError(503, f"engine stopped: {svc.engine.error}", "server_error", code="engine_unavailable")
    return {"status": "ok", "tier": "cloud", "role": svc.role, "version": cascade.__version__,
            "model": svc.model_id, "pid": os.getpid(),
            "engine": svc.engine.stats(), "kv_address": svc.decode.address if svc.decode else None}


@ops.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request):
    svc = service(request)
    svc.metrics.refresh(svc.engine.stats())
    return PlainTextResponse(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _card(request: Request) -> dict:
    """The model's card, with its ``tokenizer`` identity (a device's draft must name the same)."""
    svc = service(request)
    engine = request.app.state.config.engine
    tokenizer = svc.tokenizer_identity()
    embedding = await asyncio.to_thread(svc.embeddings.identity)  # hashed once (a sidecar file keeps it)
    card = ModelCard(id=svc.model_id, created=request.app.state.started,
                     meta={"max_model_len": svc.max_model_len, "dtype": svc.engine.engine.config.dtype,
                           "kv_cache_dtype": engine.kv_cache_dtype, "tokenizer": tokenizer,
                           **({"embedding": embedding} if embedding else {})})
    # ModelCard has no ``tokenizer`` field (cascade/protocol.py): added to its JSON here
    return {**card.model_dump(mode="json"), "tokenizer": tokenizer}


@v1.get("/models", responses={200: {"model": ModelList}, **openapi.errors(401, 500)})
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [await _card(request)]})


@v1.get("/models/{model:path}", responses={200: {"model": ModelCard}, **openapi.errors(401, 404, 500)})
async def get_model(request: Request, model: str) -> JSONResponse:
    service(request).check_model(model)
    return JSONResponse(await _card(request))


@v1.post("/chat/completions", openapi_extra=openapi.body(ChatCompletionRequest),
         responses={**openapi.generation(ChatCompletion, "chat.completion.chunk"), **_GENERATION_ERRORS})
async def chat_completions(request: Request):
    svc = service(request)
    body = await read_json(request, request.app.state.config.server.max_body_bytes)
    req = parse_body(ChatCompletionRequest, body)
    job = svc.chat_job(req, request.headers)
    fmt = formatter_for("chat", svc.model_id, req)
    return await openai_response(request, svc.run(job), fmt, req.stream, req.include_usage_in_stream(),
                                 _counter(svc, "chat"))


@v1.post("/completions", openapi_extra=openapi.body(CompletionRequest),
         responses={**openapi.generation(Completion, "text_completion"), **_GENERATION_ERRORS})
async def completions(request: Request):
    svc = service(request)
    body = await read_json(request, request.app.state.config.server.max_body_bytes)
    req = parse_body(CompletionRequest, body)
    job = svc.completion_job(req, request.headers)
    fmt = formatter_for("completions", svc.model_id, req)
    return await openai_response(request, svc.run(job), fmt, req.stream, req.include_usage_in_stream(),
                                 _counter(svc, "completions"))


@v1.post("/embeddings", openapi_extra=openapi.body(EmbeddingRequest),
         responses=openapi.errors(400, 401, 404, 413, 500, 503))
async def embeddings(request: Request):
    """OpenAI's embeddings: the model's pooled final hidden state, computed between the engine's steps."""
    svc = service(request)
    body = await read_json(request, request.app.state.config.server.max_body_bytes)
    req = parse_body(EmbeddingRequest, body)
    svc.check_model(req.model)
    try:
        answer = await svc.embeddings.serve(req)
    except EngineDeadError as e:
        raise errors.APIError(503, str(e), "server_error", code="engine_unavailable") from e
    svc.metrics.requests.labels(endpoint="embeddings", status="200").inc()
    return JSONResponse(answer)


def _counter(svc: WorkerService, endpoint: str):
    def count(status: str) -> None:
        svc.metrics.requests.labels(endpoint=endpoint, status=status).inc()
    return count


# -- the internal API the gateway and the other workers call ----------------------------------

async def _body(request: Request, model):
    raw = await request.body()
    if len(raw) > request.app.state.config.server.max_body_bytes:
        raise errors.APIError(413, "request body too large", "invalid_request_error", code="request_too_large")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise errors.validation_error(e.errors()) from e


@internal.get("/load", responses=openapi.errors(401, 500))
async def load(request: Request) -> WorkerLoadReport:
    svc = service(request)
    st = svc.engine.stats()
    return WorkerLoadReport(role=svc.role, model=svc.model_id, max_model_len=svc.max_model_len,
                            block_size=svc.engine.engine.config.block_size, kv_blocks_total=st["kv_blocks_total"],
                            kv_blocks_free=st["kv_blocks_free"], waiting=st["waiting"], running=st["running"],
                            prefix_cache_queries=st["prefix_cache_queries"],
                            prefix_cache_hits=st["prefix_cache_hits"],
                            kv_address=svc.decode.address if svc.decode else None)


@internal.get("/stats", responses=openapi.errors(401, 500, 503))
async def stats(request: Request) -> WorkerStats:
    """What this worker holds now: the engine's requests and KV blocks, prefills and transfers in flight."""
    try:
        return await service(request).stats()
    except EngineDeadError as e:
        raise errors.APIError(503, str(e), "server_error", code="engine_unavailable") from e


@internal.get("/tokenizer", responses=openapi.errors(401, 500))
async def served_model(request: Request) -> ServedModel:
    return await asyncio.to_thread(service(request).served_model)  # the first call writes files


@internal.post("/prefill", openapi_extra=openapi.body(PrefillRequest),
               responses={**openapi.generation(PrefillResponse), **openapi.errors(400, 401, 413, 500)})
async def prefill(request: Request):
    svc = service(request)
    if svc.prefill is None:
        raise errors.bad_request(f"this worker's role is {svc.role}: it does not prefill for others")
    body = await _body(request, PrefillRequest)
    try:
        resp = await while_connected(request, svc.prefill.prefill(body))
    except CallerGone:  # the decode worker gave the request up: it was aborted here, its KV freed
        return Response(status_code=499)
    return Response(resp.model_dump_json(), media_type="application/json")


@internal.post("/generate", openapi_extra=openapi.body(GenerateRequest), response_class=Response,
               responses={200: {"description": "Generation events, one JSON object a line (cascade.generation).",
                                "content": {"application/x-ndjson": {"schema": {"type": "string"}}}},
                          **openapi.errors(400, 401, 413, 429, 500, 502, 503)})
async def generate(request: Request):
    """NDJSON generation events. A failure before the first event is an HTTP error (so the
    gateway can retry elsewhere); after it, an ``{"error": ...}`` line ends the stream. A caller
    that goes away ends the request wherever it is (prefill, transfer, queue, decode)."""
    svc = service(request)
    body = await _body(request, GenerateRequest)
    events = svc.generate(body)
    try:
        first = await while_connected(request, anext(events))
    except CallerGone:
        await events.aclose()
        return Response(status_code=499)
    except PrefillFailed as e:
        await events.aclose()
        if e.code == "slo":
            raise errors.too_many_requests(str(e), 1.0, "slo") from e
        status = 503 if e.code in ("no_capacity", "prefill_unreachable", "transfer_failed") else 502
        raise errors.APIError(status, str(e), "server_error", code=e.code) from e
    except BaseException:
        await events.aclose()
        raise
    if await request.is_disconnected():  # the caller left while the prompt ran: stop here
        await events.aclose()
        return Response(status_code=499)
    return StreamingResponse(_ndjson(first, events), media_type="application/x-ndjson")


async def _ndjson(first, events):
    try:
        yield json.dumps(event_to_wire(first)) + "\n"
        async for ev in events:
            yield json.dumps(event_to_wire(ev)) + "\n"
    except Exception as e:  # after the first byte the only way to say it is in-band
        log.exception("generation failed mid-stream")
        yield json.dumps({"error": {"message": f"generation failed: {e}", "code": "worker_error"}}) + "\n"
    finally:
        await events.aclose()
