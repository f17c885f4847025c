"""The shell every one of our servers shares (edge agent, cloud worker, gateway)."""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

import cascade
from cascade import errors
from cascade.web.openapi import install_openapi
from cascade.web.tier_header import TierHeader

log = logging.getLogger(__name__)


def build_openai_app(title: str, lifespan, config, tier: str, *routers) -> FastAPI:
    """The shell every one of our servers shares: OpenAI error bodies, ``config`` and the start
    time on ``app.state``, the routers, ``X-Cascade-Tier`` on every response, and an OpenAPI
    document that declares the bodies and errors the routes document (``cascade.web.openapi``)."""
    app = FastAPI(title=title, version=cascade.__version__, lifespan=lifespan)
    app.state.config = config
    app.state.started = int(time.time())
    install_error_handlers(app)
    for r in routers:
        app.include_router(r)
    install_openapi(app)
    app.add_middleware(TierHeader, tier=tier)
    return app


def install_error_handlers(app) -> None:
    """Turn every failure of a FastAPI app into an OpenAI-style error body."""
    def respond(err: errors.APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(errors.APIError)
    async def _api_error(request: Request, exc: errors.APIError):
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return respond(errors.validation_error(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(errors.APIError(exc.status_code, str(exc.detail), kind,
                                headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(errors.APIError(500, "Internal server error.", "server_error"))
