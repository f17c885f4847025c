"""The sender's side of the KV transport contract (see the package docstring), and what both
ends share: payload views, checksums, addresses, tensors <-> payload bytes."""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, ClassVar

from cloud_tier.disagg.messages import TransferAck, TransferHeader, payload_checksum

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
    if not sep or not host or not (port.isascii() and port.isdigit()):
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


# Segments are handled with _posixshmem, as SharedMemory does, but not through SharedMemory: its
# attach (before Python 3.13) registers the segment with the receiver's resource tracker, which
# then warns of a leak and unlinks it at exit, and unregistering collides with the sender's own
# unregister when both share a tracker (one process, or multiprocessing children). So only the
# sender, which owns the segment, registers it: its tracker unlinks it should the sender die.


async def _close(writer: asyncio.StreamWriter) -> None:
    if writer.transport.get_write_buffer_size():
        writer.transport.abort()  # payload the receiver will not take: closing would wait on it
    else:
        writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass  # the peer reset the connection: nothing is left to close
