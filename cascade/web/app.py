"""The shell every one of our servers shares (edge agent, cloud worker, gateway)."""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
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
    # the routers' routes (their prefixes and dependencies in them already) go straight into the
    # app's list, in the order given and ahead of FastAPI's /docs and /openapi.json: the
    # include_router of FastAPI 0.165 keeps each router as one route that it matches twice a
    # request, and each route tried before the one that matches costs every request of it
    app.router.routes[:0] = [route for r in routers for route in r.routes]
    install_openapi(app)
    app.add_middleware(TierHeader, tier=tier)
    return app


class RequestRoute(APIRoute):
    """A route whose endpoint takes the ``Request`` alone and returns a ``Response``, reading and
    validating its body itself (``read_json`` + ``parse_body``, for OpenAI-style errors): it is
    called as it is, without FastAPI's per-request handler (body parsing, dependency solving,
    response serialization), which such an endpoint has no use for and which cost a gateway
    cache hit about a fifth of its instructions. The route is in the OpenAPI document as
    declared. Give it to a router: ``APIRouter(route_class=RequestRoute)``."""

    def get_route_handler(self):
        d = self.dependant
        if (d.dependencies or d.path_params or d.query_params or d.header_params or d.cookie_params
                or self.body_field is not None or self.response_field is not None):
            raise TypeError(f"{self.path}: a RequestRoute's endpoint takes the Request alone and returns a Response")
        return self.endpoint


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
