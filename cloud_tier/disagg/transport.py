"""KV transport: moves one request's KV payload from a prefill worker to a decode worker.

Contract. ``KVSender.send(address, header, payload)`` moves one contiguous payload and the
`TransferHeader` describing it to the `KVReceiver` at ``address`` and returns that receiver's
`TransferAck`. The receiver validates the transfer completely (header, length, checksum) before
its handler sees the payload, and the handler's ack goes back to the sender. A truncated or
corrupt transfer never reaches the handler: the receiver answers ok=False with code "truncated"
or "corrupt" when the connection still allows it. Any other outcome the sender cannot know (the
receiver unreachable, the connection dropped, no ack within ``timeout_s``) raises
`TransferError`: the KV may or may not have been adopted.

Two transports, one receiver. ``tcp`` sends the header frame then the raw payload on one
connection per transfer. ``shm`` (same host) copies the payload once into a shared-memory
segment the sender owns and always unlinks, and sends only the header over TCP.

    receiver = KVReceiver(adopt, model_identity="smollm2-135m/bfloat16")
    await receiver.start()
    ack = await TcpSender().send(receiver.address, header, tensor_payload(kv))
"""

from __future__ import annotations

import _posixshmem
import asyncio
import logging
import mmap
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from multiprocessing import resource_tracker
from typing import TYPE_CHECKING, ClassVar

from cloud_tier.disagg.messages import (
    CodecError,
    TransferAck,
    TransferHeader,
    TruncatedError,
    encode,
    payload_checksum,
    read_message,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Handler = Callable[[TransferHeader, memoryview], Awaitable[TransferAck]]

CHUNK = 4 << 20  # a tcp sender writes (and waits for the socket to drain) this much at a time
_THREADED_CHECKSUM_MIN = 1 << 20  # zlib.crc32 releases the GIL: hash big payloads off the loop


class TransferError(ConnectionError):
    """The transfer's outcome is unknown: the receiver was unreachable, the connection dropped,
    or no ack came within the timeout."""


class KVSender(ABC):
    """Moves one request's KV payload to a `KVReceiver` and returns its ack (see the module
    docstring for the contract)."""

    transport: ClassVar[str]

    def __init__(self, timeout_s: float = 30.0):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s

    async def send(self, address: str, header: TransferHeader, payload) -> TransferAck:
        """Send ``payload`` (any C-contiguous buffer: bytes, memoryview, `tensor_payload`) to the
        receiver at ``address`` ("host:port") and return its ack. The header's transport,
        nbytes, checksum and shm_name are filled here; its dtype and shape must describe the
        payload (ValueError if not). `TransferError` if the outcome is unknown, or an shm
        payload could not be staged."""
        view = _byte_view(payload)
        if view.nbytes != header.expected_nbytes:
            raise ValueError(f"payload is {view.nbytes} bytes, header {header.dtype}{header.shape} "
                             f"says {header.expected_nbytes}")
        header = header.model_copy(update={"transport": self.transport, "nbytes": view.nbytes,
                                           "checksum": await _checksum(view), "shm_name": None})
        return await self._send(address, header, view)

    @abstractmethod
    async def _send(self, address: str, header: TransferHeader, payload: memoryview) -> TransferAck:
        ...

    async def _connect(self, address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port = _split_address(address)
        try:
            return await asyncio.wait_for(asyncio.open_connection(host, port), self.timeout_s)
        except (OSError, TimeoutError) as e:
            raise TransferError(f"cannot reach the KV receiver at {address}: {e!r}") from e

    def _ack_of(self, reading: asyncio.Task, address: str) -> TransferAck:
        if not reading.done():
            raise TransferError(f"no ack from {address} within {self.timeout_s}s")
        if (exc := reading.exception()) is not None:
            raise TransferError(f"no valid ack from {address}: {exc}") from exc
        return reading.result()


class TcpSender(KVSender):
    """The header frame then the raw payload, on one TCP connection per transfer."""

    transport = "tcp"

    async def _send(self, address: str, header: TransferHeader, payload: memoryview) -> TransferAck:
        reader, writer = await self._connect(address)
        # The ack is read while the payload goes out: a receiver that refuses the header acks
        # at once and closes without reading the payload.
        reading = asyncio.create_task(read_message(reader, TransferAck))
        writing = asyncio.create_task(self._write(writer, encode(header), payload))
        try:
            await asyncio.wait({reading, writing}, return_when=asyncio.FIRST_COMPLETED)
            if not reading.done():
                if isinstance(writing.exception(), TimeoutError):
                    raise TransferError(f"{address} took no payload for {self.timeout_s}s")
                # Written, or the connection broke (a refusal's ack may still be in flight).
                await asyncio.wait({reading}, timeout=self.timeout_s)
            return self._ack_of(reading, address)
        finally:
            reading.cancel()
            writing.cancel()
            await asyncio.gather(reading, writing, return_exceptions=True)
            await _close(writer)

    async def _write(self, writer: asyncio.StreamWriter, frame: bytes, payload: memoryview) -> None:
        writer.write(frame)
        for start in range(0, payload.nbytes, CHUNK):
            writer.write(payload[start:start + CHUNK])
            async with asyncio.timeout(self.timeout_s):
                await writer.drain()
        async with asyncio.timeout(self.timeout_s):
            await writer.drain()


class ShmSender(KVSender):
    """Same host only: the payload is copied once into a shared-memory segment that this sender
    creates and always unlinks after the ack or on any error; only the header crosses TCP."""

    transport = "shm"

    async def _send(self, address: str, header: TransferHeader, payload: memoryview) -> TransferAck:
        reader, writer = await self._connect(address)
        name = f"cascade-kv-{uuid.uuid4().hex}"
        try:
            try:
                segment = _create_segment(name, max(payload.nbytes, 1))
            except OSError as e:
                raise TransferError(
                    f"cannot stage {payload.nbytes} bytes in shared memory: {e}") from e
            try:
                segment[:payload.nbytes] = payload
                writer.write(encode(header.model_copy(update={"shm_name": name})))
                reading = asyncio.create_task(read_message(reader, TransferAck))
                try:
                    await asyncio.wait({reading}, timeout=self.timeout_s)
                    return self._ack_of(reading, address)
                finally:
                    reading.cancel()
                    await asyncio.gather(reading, return_exceptions=True)
            finally:
                _remove_segment(name, segment)
        finally:
            await _close(writer)


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


def payload_to_tensor(header: TransferHeader, payload: memoryview) -> torch.Tensor:
    """The payload as a ``header.shape`` tensor of ``header.dtype``, sharing its memory (no copy):
    copy from it before the handler returns."""
    import torch  # here, not at the top: moving bytes needs no torch (and starts faster)

    if payload.nbytes != header.expected_nbytes:
        raise ValueError(f"payload is {payload.nbytes} bytes, header says {header.expected_nbytes}")
    dtype = getattr(torch, header.dtype)
    if payload.nbytes == 0:
        return torch.empty(header.shape, dtype=dtype)
    return torch.frombuffer(payload, dtype=dtype).view(header.shape)


def tensor_payload(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying (any dtype, bfloat16 included). The
    view keeps the tensor alive."""
    import torch

    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"need a contiguous CPU tensor, got {t.device} "
                         f"contiguous={t.is_contiguous()}")
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def _refusal(request_id: str, code: str, message: str) -> TransferAck:
    """The receiver's own refusal (the handler's are its business to log)."""
    log.warning("refused KV transfer %r: %s: %s", request_id, code, message)
    return TransferAck(request_id=request_id, ok=False, code=code, message=message)


def _byte_view(payload) -> memoryview:
    view = memoryview(payload)
    if not view.c_contiguous:
        raise ValueError("the payload must be one contiguous buffer")
    return view.cast("B")


async def _checksum(view: memoryview) -> str:
    if view.nbytes >= _THREADED_CHECKSUM_MIN:
        return await asyncio.to_thread(payload_checksum, view)
    return payload_checksum(view)


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


# Segments are handled with _posixshmem, as SharedMemory does, but not through SharedMemory: its
# attach (before Python 3.13) registers the segment with the receiver's resource tracker, which
# then warns of a leak and unlinks it at exit, and unregistering collides with the sender's own
# unregister when both share a tracker (one process, or multiprocessing children). So only the
# sender, which owns the segment, registers it: its tracker unlinks it should the sender die.


def _create_segment(name: str, size: int) -> mmap.mmap:
    """A new segment with its memory reserved up front: writing into tmpfs pages it cannot back
    kills the process with SIGBUS (a container's /dev/shm is often 64 MB); posix_fallocate fails
    with ENOSPC instead."""
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    resource_tracker.register("/" + name, "shared_memory")
    try:
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except BaseException:
        _posixshmem.shm_unlink("/" + name)
        resource_tracker.unregister("/" + name, "shared_memory")
        raise
    finally:
        os.close(fd)


def _remove_segment(name: str, mapping: mmap.mmap) -> None:
    mapping.close()
    _posixshmem.shm_unlink("/" + name)
    resource_tracker.unregister("/" + name, "shared_memory")


def _map_segment(name: str, nbytes: int) -> mmap.mmap:
    """The sender's segment, mapped without registering it (see above)."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"segment {name} is {size} bytes, the header says {nbytes}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


async def _close(writer: asyncio.StreamWriter) -> None:
    if writer.transport.get_write_buffer_size():
        writer.transport.abort()  # payload the receiver will not take: closing would wait on it
    else:
        writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass  # the peer reset the connection: nothing is left to close
