"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Every API of ours (edge agent, gateway, workers) raises ``APIError`` for a request it refuses
and installs ``install_error_handlers`` so that nothing reaches the client as a bare 500.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger(__name__)


class APIError(Exception):
    """A request refused with an HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def sse(self) -> str:
        """The error as one SSE event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str = "Invalid or missing API key.") -> APIError:
    return APIError(401, message, "authentication_error", None, "invalid_api_key",
                    {"WWW-Authenticate": "Bearer"})


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist.", "invalid_request_error", "model",
                    "model_not_found")


def too_many_requests(message: str, retry_after_s: float, code: str = "rate_limit_exceeded") -> APIError:
    retry = max(1, int(retry_after_s + 0.999))
    return APIError(429, message, "rate_limit_error", None, code, {"Retry-After": str(retry)})


def install_error_handlers(app) -> None:
    """Turn every failure of a FastAPI app into an OpenAI-style error body."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    def respond(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return respond(validation_error(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(APIError(exc.status_code, str(exc.detail), kind,
                                headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(APIError(500, "Internal server error.", "server_error"))


def validation_error(errors) -> APIError:
    """A pydantic/FastAPI validation failure as a 400 naming the first bad parameter."""
    if not errors:
        return bad_request("Invalid request.")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return bad_request("The request body is not valid JSON.", None, "invalid_json")
    msg = first.get("msg", "invalid value")
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    return bad_request(f"Invalid value for '{param}': {msg}." if param else f"{msg}.", param,
                       "invalid_value")
