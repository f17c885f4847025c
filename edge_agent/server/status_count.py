"""Every answer of the OpenAI API (``/v1/...``) counted once in ``cascade_edge_requests_total``
with its HTTP status, whichever part of the app gives it: a handler (200, 202, 499), an error the
app's exception handlers turn into a response, raised in a handler or before it runs (bad JSON,
401, 404, 413, 429, 503), or an unexpected exception (500). The fleet's error rate and the
rollout gate read these counts (edge telemetry ``requests``), so an answer missed here is an error
the fleet never sees. ``/healthz``, ``/metrics`` and the docs are not counted."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

# the ``endpoint`` label: what the routes have always used for the generation endpoints, a
# fixed name for the others, and one name for any other /v1 path (its 404), so the series stay few
_EXACT = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/models": "models",
          "/v1/embeddings": "embeddings"}
_PREFIXES = (("/v1/models/", "models"), ("/v1/requests/", "requests"))
_SCOPE_KEY = "cascade.answer"


def endpoint_label(path: str) -> str | None:
    """The ``endpoint`` label of a request path; None for a path that is not counted (outside /v1)."""
    if label := _EXACT.get(path):
        return label
    if not path.startswith("/v1/"):
        return None
    return next((label for prefix, label in _PREFIXES if path.startswith(prefix)), "other")


@dataclass
class _Answer:
    started: str | None = None  # the status the response started with
    ended: str | None = None  # what a handler says it ended with (``settle``)


def settle(request: Request, status: str) -> None:
    """Say how an answer ended when that is not the status it started with: a stream that started
    200 and then failed ("500", or the peer's status) or lost its client ("499") is counted so,
    once, instead of as 200. The ``count`` that ``cascade.web.openai_response`` calls."""
    answer = request.scope.get(_SCOPE_KEY)
    if answer is not None:
        answer.ended = status


class CountAnswers:
    """Pure ASGI middleware counting each /v1 response once, when it is over. It sits outside the
    app's exception handlers, so it sees the status they answer with; an exception that gets past
    them before anything was sent becomes the 500 the app's outermost handler answers. The counter
    is the serving agent's (``app.state.service.metrics``), made when its lifespan starts."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        endpoint = endpoint_label(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        answer = scope[_SCOPE_KEY] = _Answer()

        async def send_noting_status(message):
            if message["type"] == "http.response.start":
                answer.started = str(message["status"])
            await send(message)

        failed = False
        try:
            await self.app(scope, receive, send_noting_status)
        except Exception:
            failed = True
            raise
        finally:
            status = answer.ended or answer.started or ("500" if failed else None)
            service = getattr(scope["app"].state, "service", None)
            if status is not None and service is not None:  # None: cancelled with nothing sent
                service.metrics.requests.labels(endpoint=endpoint, status=status).inc()
