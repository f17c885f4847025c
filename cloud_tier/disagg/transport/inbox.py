"""One KV receiver connection, read on request straight into the caller's buffer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

_STEP = 64 << 10  # readexactly's step


class Inbox(asyncio.BufferedProtocol):
    """One receiver connection that reads only on request, straight into the caller's buffer
    (recv_into: no intermediate copies, never past what was asked, so no read-ahead to hand
    over between the header frame and the payload)."""

    def __init__(self, on_connect: Callable[[Inbox], None], idle_timeout_s: float):
        self._on_connect = on_connect
        self._idle_timeout_s = idle_timeout_s
        self._transport: asyncio.Transport | None = None
        self._target: memoryview | None = None
        self._filled = 0
        self._done: asyncio.Future | None = None
        self._eof = False
        # uvloop may ask for a buffer after reading was paused, with no read in progress:
        # what arrives then waits here for the next readinto
        self._scratch = memoryview(bytearray(64 << 10))
        self._into_scratch = False
        self._spill = bytearray()
        self.dropped = False

    async def readexactly(self, n: int) -> bytes:
        """``n`` bytes, read in steps: what is held grows with what arrived, never with what a
        frame's prefix claims."""
        buf = bytearray()
        while len(buf) < n:
            step = memoryview(bytearray(min(n - len(buf), _STEP)))
            got = await self.readinto(step)
            buf += step[:got]
            if got < step.nbytes:
                raise asyncio.IncompleteReadError(bytes(buf), n)
        return bytes(buf)

    async def readinto(self, view: memoryview) -> int:
        """Fill ``view``; fewer bytes only if the stream ended. `TimeoutError` if no byte came
        for the idle timeout."""
        view = view.cast("B")
        taken = min(len(self._spill), view.nbytes)
        if taken:
            view[:taken] = self._spill[:taken]
            del self._spill[:taken]
        if self._eof or taken == view.nbytes:
            return taken
        self._target, self._filled = view, taken
        self._done = asyncio.get_running_loop().create_future()
        self._transport.resume_reading()
        try:
            while not self._done.done():
                before = self._filled
                await asyncio.wait({self._done}, timeout=self._idle_timeout_s)
                if not self._done.done() and self._filled == before:
                    raise TimeoutError(f"no data for {self._idle_timeout_s}s after "
                                       f"{self._filled} of {view.nbytes} bytes")
            return self._filled
        finally:
            self._target = None
            self._transport.pause_reading()

    def write(self, data: bytes) -> None:
        if not self.dropped:
            self._transport.write(data)

    def close(self) -> None:
        self._transport.close()

    def drop(self) -> None:
        """End the connection now, unread data and unsent acks lost: a read in progress returns
        what it has."""
        self.dropped = True
        self._transport.abort()

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        transport.pause_reading()
        self._on_connect(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None and self._filled < self._target.nbytes:
            return self._target[self._filled:]
        self._into_scratch = True
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_scratch:
            self._into_scratch = False
            self._spill += self._scratch[:nbytes]
            return
        self._filled += nbytes
        if self._filled == self._target.nbytes:
            self._transport.pause_reading()
            self._done.set_result(None)

    def eof_received(self) -> bool:
        self._end()
        return True  # stay open: a truncated sender that half-closed still gets its ack

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()

    def _end(self) -> None:
        self._eof = True
        if self._done is not None and not self._done.done():
            self._done.set_result(None)
