"""A TCP proxy that injects faults between a client and a real server (PostgreSQL, Redis): every
byte delayed by ``delay_s`` in each direction, or the server made unreachable (``down()``: every
open connection cut, new ones refused) and reachable again (``up()``). It runs its own event loop
in a thread, so the code under test sees a server that answers slowly or not at all."""

from __future__ import annotations

import asyncio
import threading

from cascade.processes import free_port


class FaultProxy:
    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.port = free_port()
        self.delay_s = 0.0
        self._down = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._started.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._started.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._down:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def url(self, scheme_and_rest: str) -> str:
        """``scheme_and_rest`` with ``{port}`` filled in with the proxy's."""
        return scheme_and_rest.format(port=self.port)

    def down(self) -> None:
        def cut():
            self._down = True
            for w in list(self._writers):
                w.transport.abort()

        self._loop.call_soon_threadsafe(cut)

    def up(self) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "_down", False)

    def close(self) -> None:
        self.down()
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
