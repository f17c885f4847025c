"""Every request body of the gateway bounded while it arrives (an ASGI middleware)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from cloud_tier.gateway.batch.routes import body_too_large


class BodyLimit:
    """Every request body bounded while it arrives: a declared Content-Length over the route's
    limit is a 413 before a byte is read, and a body (chunked or not) that grows past it is a
    413 (raised from ``receive``, so the route stops reading there) - an upload is never read or
    spooled past its limit. ``routes``: (method, path) -> a limit of its own."""

    def __init__(self, app, limit: int, routes: dict[tuple[str, str], int]):
        self.app = app
        self.limit = limit
        self.routes = routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.routes.get((scope["method"], scope["path"]), self.limit)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            err = body_too_large(limit)
            return await JSONResponse(err.body(), err.status, {"connection": "close"})(scope, receive, send)
        seen = 0

        async def bounded():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise body_too_large(limit)
            return message

        async def closing(message):  # past the limit: the connection closes, the rest is never read
            if message["type"] == "http.response.start" and seen > limit:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, bounded, closing)
