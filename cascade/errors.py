"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Every API of ours (edge agent, gateway, workers) raises ``APIError`` for a request it refuses;
``cascade.web.app`` turns it (and anything unexpected) into the body, never a bare 500.
"""

from __future__ import annotations

import json
import math


def one_line(exc: BaseException, limit: int | None = None) -> str:
    """The first line of ``exc``'s message (at most ``limit`` characters; "" when it has none): the
    cause a one-line error names, where the library's own message runs on with a traceback or a dump."""
    return str(exc).strip().partition("\n")[0][:limit]


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
    # whole seconds, rounded up (a client told 3 for 3.0005 s would come back early), within a day
    retry = min(max(1, math.ceil(retry_after_s)), 86_400) if math.isfinite(retry_after_s) else 86_400
    return APIError(429, message, "rate_limit_error", None, code, {"Retry-After": str(retry)})


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
