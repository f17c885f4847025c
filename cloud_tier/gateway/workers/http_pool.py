"""The gateway's HTTP connection pool to its workers, spread over several httpcore pools.

httpcore's pool walks all its connections on every request and every release, and for each
one counts the idle ones again (``_assign_requests_to_connections``), polling each idle socket's
readability: cubic in the connections open. With one connection per stream in flight, at 160
concurrent streams that was about half of the gateway's CPU (py-spy), and the gateway shares
the machine with its workers. ``ShardedTransport`` gives each request to whichever of ``shards``
smaller pools has the fewest in flight, so each pool's walk stays short.
"""

from __future__ import annotations

import math

import httpx

# Idle connections to a worker are dropped after this long: below the keep-alive of the servers
# behind the gateway (ours 30 s, uvicorn's and so vLLM's default 5 s), so the gateway never sends a
# request on a connection the worker is closing at that moment.
KEEPALIVE_EXPIRY_S = 3.0


class ShardedTransport(httpx.AsyncBaseTransport):
    def __init__(self, limits: httpx.Limits, shards: int = 8):
        per_shard = httpx.Limits(
            max_connections=None if limits.max_connections is None else math.ceil(limits.max_connections / shards),
            max_keepalive_connections=None if limits.max_keepalive_connections is None
            else math.ceil(limits.max_keepalive_connections / shards),
            keepalive_expiry=limits.keepalive_expiry)
        self._shards = [httpx.AsyncHTTPTransport(limits=per_shard) for _ in range(shards)]
        self._in_flight = [0] * shards

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        i = min(range(len(self._shards)), key=self._in_flight.__getitem__)
        self._in_flight[i] += 1
        try:
            response = await self._shards[i].handle_async_request(request)
        except BaseException:
            self._in_flight[i] -= 1
            raise
        response.stream = _Released(response.stream, lambda: self._release(i))
        return response

    def _release(self, i: int) -> None:
        self._in_flight[i] -= 1

    async def aclose(self) -> None:
        for shard in self._shards:
            await shard.aclose()


class _Released(httpx.AsyncByteStream):
    """A response body that calls ``on_close`` once, when it is closed (read to its end, or not)."""

    def __init__(self, stream: httpx.AsyncByteStream, on_close):
        self._stream = stream
        self._on_close = on_close

    async def __aiter__(self):
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        on_close, self._on_close = self._on_close, None
        try:
            await self._stream.aclose()
        finally:
            if on_close is not None:
                on_close()
