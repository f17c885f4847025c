"""The receiving end: one listener for both transports, which validates a transfer completely
(header, model identity, length, checksum) before its handler sees the payload."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from cloud_tier.disagg.messages import (
    CodecError,
    TransferAck,
    TransferHeader,
    TruncatedError,
    encode,
    read_message,
)
from cloud_tier.disagg.transport.base import Handler, _checksum, _refusal
from cloud_tier.disagg.transport.shm import _map_segment

log = logging.getLogger(__name__)


class KVReceiver:
    """Accepts tcp and shm KV transfers, validates each completely and passes it to ``handler``,
    whose ack goes back to the sender.

    The payload view is valid only while the handler runs (for shm it maps the sender's
    segment, unmapped right after the handler returns): copy out what you keep before
    returning, e.g. ``payload_to_tensor(header, payload)`` into your KV blocks.

    A transfer is refused before its payload with code "model_mismatch" (``model_identity`` is
    set and differs) or "bad_header" (malformed, nbytes not shape x dtype, over ``max_nbytes``,
    or no such shm segment). A sender that sends nothing for ``timeout_s`` is dropped.
    """

    def __init__(self, handler: Handler, model_identity: str | None = None,
                 max_nbytes: int = 8 << 30, timeout_s: float = 30.0):
        if max_nbytes < 0 or timeout_s <= 0:
            raise ValueError("max_nbytes must be >= 0 and timeout_s > 0")
        self.handler = handler
        self.model_identity = model_identity
        self.max_nbytes = max_nbytes
        self.timeout_s = timeout_s
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        if self._server is not None:
            raise RuntimeError("the receiver is already started")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Inbox(self._accept, self.timeout_s), host, port)

    @property
    def address(self) -> str:
        """"host:port" of the bound socket."""
        if self._server is None:
            raise RuntimeError("the receiver is not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def close(self) -> None:
        """Stop listening and abort transfers in flight (their senders get `TransferError`)."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    def _accept(self, inbox: _Inbox) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(inbox))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _serve(self, inbox: _Inbox) -> None:
        try:
            try:
                ack = await self._receive(inbox)
            except Exception as e:
                log.exception("KV receiver failed on a transfer")
                ack = TransferAck(request_id="", ok=False, code="error", message=repr(e))
            inbox.write(encode(ack))
        finally:
            inbox.close()  # after the ack is flushed

    async def _receive(self, inbox: _Inbox) -> TransferAck:
        try:
            async with asyncio.timeout(self.timeout_s):
                header = await read_message(inbox, TransferHeader)
        except (TruncatedError, TimeoutError) as e:
            return _refusal("", "truncated", f"header: {e!r}")
        except CodecError as e:
            return _refusal("", "bad_header", str(e))
        if (problem := self._check(header)) is not None:
            return _refusal(header.request_id, *problem)
        if header.transport == "tcp":
            payload = bytearray(header.nbytes)
            try:
                received = await inbox.readinto(memoryview(payload))
            except TimeoutError as e:
                return _refusal(header.request_id, "truncated", f"payload: {e}")
            if received < header.nbytes:
                return _refusal(header.request_id, "truncated",
                                f"stream ended after {received} of {header.nbytes} payload bytes")
            return await self._deliver(header, memoryview(payload))
        try:
            mapping = _map_segment(header.shm_name, header.nbytes)
        except (OSError, ValueError) as e:
            return _refusal(header.request_id, "bad_header", f"shm segment: {e!r}")
        view = memoryview(mapping)[:header.nbytes]
        try:
            return await self._deliver(header, view)
        finally:
            view.release()
            try:
                mapping.close()  # never unlink: the sender owns the segment
            except BufferError:
                log.warning("the handler kept a view of shm segment %s; it stays mapped until "
                            "that view is collected", header.shm_name)

    def _check(self, header: TransferHeader) -> tuple[str, str] | None:
        if self.model_identity is not None and header.model_identity != self.model_identity:
            return "model_mismatch", (f"receiver holds {self.model_identity!r}, the KV is for "
                                      f"{header.model_identity!r}")
        if header.transport == "shm" and header.shm_name is None:
            return "bad_header", "an shm transfer without shm_name"
        if header.nbytes != header.expected_nbytes:
            return "bad_header", (f"nbytes {header.nbytes} != {header.dtype}{header.shape} = "
                                  f"{header.expected_nbytes}")
        if header.nbytes > self.max_nbytes:
            return "bad_header", f"nbytes {header.nbytes} over the {self.max_nbytes}-byte limit"
        return None

    async def _deliver(self, header: TransferHeader, payload: memoryview) -> TransferAck:
        checksum = await _checksum(payload)
        if checksum != header.checksum:
            return _refusal(header.request_id, "corrupt",
                            f"checksum {checksum}, header says {header.checksum}")
        try:
            return await self.handler(header, payload)
        except Exception as e:
            log.exception("KV handler failed on request %r", header.request_id)
            return TransferAck(request_id=header.request_id, ok=False, code="error",
                               message=f"handler failed: {e!r}")


class _Inbox(asyncio.BufferedProtocol):
    """One receiver connection that reads only on request, straight into the caller's buffer
    (recv_into: no intermediate copies, never past what was asked, so no read-ahead to hand
    over between the header frame and the payload)."""

    def __init__(self, on_connect: Callable[[_Inbox], None], idle_timeout_s: float):
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

    async def readexactly(self, n: int) -> bytes:
        buf = bytearray(n)
        got = await self.readinto(memoryview(buf))
        if got < n:
            raise asyncio.IncompleteReadError(bytes(buf[:got]), n)
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
        self._transport.write(data)

    def close(self) -> None:
        self._transport.close()

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
