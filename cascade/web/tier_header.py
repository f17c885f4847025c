"""Every response says which tier answered: ``X-Cascade-Tier``."""

from __future__ import annotations

TIER_HEADER = "X-Cascade-Tier"


class TierHeader:
    """Pure ASGI middleware: every HTTP response says which tier answered, unless the handler
    already did (an edge agent relaying the cloud's answer). (Not
    BaseHTTPMiddleware, which would get in the way of cancelling a stream on disconnect.)"""

    def __init__(self, app, tier: str):
        self.app = app
        self.header = (TIER_HEADER.lower().encode(), tier.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_tier(message):
            if message["type"] == "http.response.start":
                headers = message.get("headers", [])
                if not any(h[0].lower() == self.header[0] for h in headers):  # a handler may say another tier
                    message = {**message, "headers": [*headers, self.header]}
            await send(message)

        await self.app(scope, receive, send_with_tier)
