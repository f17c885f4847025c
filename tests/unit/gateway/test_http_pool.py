"""The gateway's sharded connection pool against a real socket server: requests spread over the
shards, every shard's count of requests in flight comes back to zero however the response ends
(read to its end, closed half-read, a server that drops the connection), and bodies arrive whole."""

import asyncio

import httpx
import pytest

from cloud_tier.gateway.workers.http_pool import ShardedTransport


async def _server(behaviour):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ")[1].decode()
                if not await behaviour(path, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _answer(path: str, writer: asyncio.StreamWriter) -> bool:
    if path == "/drop":  # headers, part of a chunked body, then the connection goes
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        return False
    if path == "/slow":
        await asyncio.sleep(0.2)
    body = path.encode() * 1000
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    return True


def test_requests_spread_over_the_shards_and_each_count_returns_to_zero():
    async def main():
        server, url = await _server(_answer)
        transport = ShardedTransport(httpx.Limits(max_connections=64, max_keepalive_connections=16), shards=4)
        async with server, httpx.AsyncClient(transport=transport, timeout=5) as client:
            seen = []

            async def slow(i):
                async with client.stream("GET", f"{url}/slow") as r:
                    seen.append(list(transport._in_flight))
                    assert (await r.aread()) == b"/slow" * 1000

            await asyncio.gather(*(slow(i) for i in range(8)))
            assert max(max(s) for s in seen) == 2  # 8 at once over 4 shards: 2 each, never 3 on one
            assert transport._in_flight == [0, 0, 0, 0]

            async with client.stream("GET", f"{url}/half") as r:  # closed before its body is read
                assert r.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get(f"{url}/drop")
            with pytest.raises(httpx.ConnectError):
                await client.get("http://127.0.0.1:1/nothing")
            assert transport._in_flight == [0, 0, 0, 0]
            r = await client.get(f"{url}/again")  # the shards still serve
            assert r.content == b"/again" * 1000 and transport._in_flight == [0, 0, 0, 0]

    asyncio.run(main())


def test_a_cancelled_request_gives_its_place_back():
    async def main():
        server, url = await _server(_answer)
        transport = ShardedTransport(httpx.Limits(max_connections=8, max_keepalive_connections=8), shards=2)
        async with server, httpx.AsyncClient(transport=transport, timeout=5) as client:
            task = asyncio.create_task(client.get(f"{url}/slow"))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert transport._in_flight == [0, 0]

    asyncio.run(main())
