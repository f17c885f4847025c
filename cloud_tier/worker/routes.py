"""Thin handlers of the worker's OpenAI-compatible API."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cascade import errors
from cascade.api import openai_response, parse_body, read_json, require_api_key
from cascade.openai_format import ChatFormatter, CompletionFormatter
from cascade.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from cloud_tier.worker.service import WorkerService


def service(request: Request) -> WorkerService:
    return request.app.state.service


router = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


@router.get("/healthz")
@router.get("/health")
async def healthz(request: Request):
    svc = service(request)
    if svc.engine.error is not None:
        raise errors.APIError(503, f"engine stopped: {svc.engine.error}", "server_error", code="engine_unavailable")
    return {"status": "ok", "tier": "cloud", "role": request.app.state.config.worker.role,
            "model": svc.model_id, "engine": svc.engine.stats()}


@router.get("/metrics")
async def metrics(request: Request):
    svc = service(request)
    svc.metrics.refresh(svc.engine.stats())
    return PlainTextResponse(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _card(request: Request) -> ModelCard:
    svc = service(request)
    return ModelCard(id=svc.model_id, created=request.app.state.started,
                     meta={"max_model_len": svc.max_model_len, "dtype": request.app.state.config.engine.dtype})


@v1.get("/models")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_card(request)])


@v1.get("/models/{model:path}")
async def get_model(request: Request, model: str) -> ModelCard:
    service(request).check_model(model)
    return _card(request)


@v1.post("/chat/completions")
async def chat_completions(request: Request):
    svc = service(request)
    req = parse_body(ChatCompletionRequest, await read_json(request, request.app.state.config.server.max_body_bytes))
    job = svc.chat_job(req)
    fmt = ChatFormatter(svc.model_id, req.logprobs)
    return await openai_response(request, svc.run(job), fmt, req.stream, req.include_usage_in_stream(),
                                 _counter(svc, "chat"))


@v1.post("/completions")
async def completions(request: Request):
    svc = service(request)
    req = parse_body(CompletionRequest, await read_json(request, request.app.state.config.server.max_body_bytes))
    job = svc.completion_job(req)
    fmt = CompletionFormatter(svc.model_id, req.logprobs)
    return await openai_response(request, svc.run(job), fmt, req.stream, req.include_usage_in_stream(),
                                 _counter(svc, "completions"))


def _counter(svc: WorkerService, endpoint: str):
    def count(status: str) -> None:
        svc.metrics.requests.labels(endpoint=endpoint, status=status).inc()
    return count
