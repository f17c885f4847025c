"""The gateway's HTTP client for its hot and frequent calls to workers: relaying an OpenAI-
compatible worker's answer (vLLM, SGLang, any) and polling every worker's health and load.
aiohttp, whose C HTTP parser reads a stream's chunked body at a fraction of what httpx + httpcore
+ h11 (pure Python) spent per token (py-spy under `vllm bench serve`: ~16% of the gateway's CPU,
and most of each poll's).

``WorkerHTTP.send`` gives the worker's response once its headers are in; its failures are ours:
``Unreachable`` (no connection: the worker is down), ``WorkerBroke`` (the connection failed after
it opened); a timeout is a TimeoutError (the caller's ``asyncio.timeout``, or no bytes for
``read_timeout_s``). One session for the
gateway's life, opened in its event loop at the first request; connections to a worker are kept
``KEEPALIVE_EXPIRY_S`` (below the workers' own keep-alive, so a request never goes out on one the
worker is closing)."""

from __future__ import annotations

import asyncio

import aiohttp
import yarl

from cloud_tier.gateway.workers.http_pool import KEEPALIVE_EXPIRY_S


class Unreachable(Exception):
    """No connection to the worker could be made."""


class WorkerBroke(Exception):
    """The connection to the worker failed after it opened (reset, closed, a malformed answer)."""


class WorkerHTTP:
    def __init__(self, connect_timeout_s: float = 2.0, read_timeout_s: float | None = None,
                 max_connections: int = 1024):
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s  # the longest wait for the worker's next bytes (TimeoutError)
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, yarl.URL] = {}  # parsed once: a worker's few endpoints, not a URL a request

    def _url(self, url: str) -> yarl.URL:
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) >= 4096:  # workers come and go (discovery): never grows without bound
                self._urls.clear()
            parsed = self._urls[url] = yarl.URL(url)
        return parsed

    def _live(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=KEEPALIVE_EXPIRY_S,
                                             enable_cleanup_closed=True)
            # no total limit here: the caller's asyncio.timeout bounds a request; no Accept-Encoding: the
            # worker answers uncompressed, the bytes relayed as it wrote them
            self._session = aiohttp.ClientSession(
                connector=connector, skip_auto_headers=("User-Agent", "Accept-Encoding"),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s,
                                              sock_read=self.read_timeout_s))
        return self._session

    async def send(self, method: str, url: str, body: bytes | None, headers: dict[str, str]
                   ) -> aiohttp.ClientResponse:
        """The response (its headers read; close it with ``release()``)."""
        try:
            return await self._live().request(method, self._url(url), data=body, headers=headers,
                                              allow_redirects=False)
        except TimeoutError:  # aiohttp's read timeout is one too
            raise
        except aiohttp.ClientConnectorError as e:
            raise Unreachable(f"{type(e).__name__}: {e}") from None
        except aiohttp.ClientError as e:
            raise WorkerBroke(f"{type(e).__name__}: {e}") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def read_some(resp: aiohttp.ClientResponse) -> bytes:
    """The next bytes of ``resp``'s body as they come (b"" at its end); WorkerBroke when cut."""
    try:
        return await resp.content.readany()
    except TimeoutError:  # no bytes within the read timeout
        raise
    except aiohttp.ClientError as e:
        raise WorkerBroke(f"{type(e).__name__}: {e}") from None


async def end_of_body(resp: aiohttp.ClientResponse, wait_s: float = 0.05, most: int = 65536) -> None:
    """Read what is left of a stream after its [DONE] (the chunked body's end, in flight): a body
    read to its end lets its connection go back to the pool. What does not end within ``wait_s``
    or ``most`` bytes is left: the connection is then closed, never waited on."""
    if resp.content.at_eof():
        return
    try:
        async with asyncio.timeout(wait_s):
            seen = 0
            while seen <= most and (data := await resp.content.readany()):
                seen += len(data)
    except (TimeoutError, aiohttp.ClientError):
        pass


async def get_bounded(http: WorkerHTTP, url: str, headers: dict, timeout_s: float, limit: int,
                      too_large: type[Exception]) -> tuple[int, bytes]:
    """(status, body) of ``GET url``, the whole answer within ``timeout_s`` (TimeoutError past it: a
    worker that drips its body never holds a poll), the body refused (``too_large("too_large", why)``)
    as soon as it passes ``limit`` bytes, never read whole."""
    async with asyncio.timeout(timeout_s):
        resp = await http.send("GET", url, None, headers)
        try:
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise too_large("too_large", f"{url}: a body of {declared} bytes (over {limit})")
            body = bytearray()
            while data := await read_some(resp):
                body += data
                if len(body) > limit:
                    raise too_large("too_large", f"{url}: a body over {limit} bytes")
            return resp.status, bytes(body)
        finally:
            resp.release()
