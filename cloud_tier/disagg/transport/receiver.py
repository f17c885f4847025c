"""The receiving end: one listener for both transports. It takes only the transfers it was told
to expect (a request id and its token), checks every header against that expectation and its
limits before it allocates anything, and validates a transfer completely (model identity,
length, checksum) before its handler sees the payload."""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass

from cloud_tier.disagg.messages import (
    CodecError,
    TransferAck,
    TransferHeader,
    TruncatedError,
    encode,
    read_message,
)
from cloud_tier.disagg.transport.base import Handler, _checksum, _refusal
from cloud_tier.disagg.transport.inbox import Inbox
from cloud_tier.disagg.transport.shm import _map_segment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceiverLimits:
    """What one receiver takes. Each is checked before a byte of a transfer's payload is
    allocated; a header frame is held only as far as it has arrived."""

    max_nbytes: int = 8 << 30  # one payload, whatever its expectation allows
    max_inflight_bytes: int = 8 << 30  # tcp payloads being received at once
    max_connections: int = 64  # beyond: closed on accept
    max_header_bytes: int = 4 << 20  # a header frame's body (its record holds the prompt)
    header_timeout_s: float = 5.0  # for the whole header, from the connection's start
    timeout_s: float = 30.0  # without a byte, mid-payload

    def __post_init__(self):
        if min(self.max_nbytes, self.max_inflight_bytes) < 0:
            raise ValueError("max_nbytes and max_inflight_bytes must be >= 0")
        if self.max_connections < 1 or self.max_header_bytes < 1:
            raise ValueError("max_connections and max_header_bytes must be >= 1")
        if self.header_timeout_s <= 0 or self.timeout_s <= 0:
            raise ValueError("header_timeout_s and timeout_s must be > 0")


@dataclass(frozen=True)
class _Expected:
    token: str
    max_nbytes: int


class KVReceiver:
    """Accepts tcp and shm KV transfers, validates each completely and passes it to ``handler``,
    whose ack goes back to the sender.

    Only expected transfers are taken: ``expect(request_id, token, max_nbytes)`` admits one
    transfer of that request carrying that token and at most that many bytes; ``forget`` takes
    it back, and drops it if it is being received. Every other header is refused with code
    "unknown_request" (one answer, whether the id or the token is wrong) and its connection
    closed, before anything is allocated for it.

    The payload view is valid only while the handler runs (for shm it maps the sender's
    segment, unmapped right after the handler returns): copy out what you keep before
    returning, e.g. ``payload_to_tensor(header, payload)`` into your KV blocks.

    An expected transfer is refused before its payload with code "model_mismatch"
    (``model_identity`` is set and differs), "bad_header" (malformed, nbytes not shape x dtype,
    over its expectation or ``limits.max_nbytes``, or no such shm segment) or "no_capacity"
    (its payload would take the bytes in flight over ``limits.max_inflight_bytes``).
    """

    def __init__(self, handler: Handler, model_identity: str | None = None,
                 limits: ReceiverLimits | None = None):
        self.handler = handler
        self.model_identity = model_identity
        self.limits = limits or ReceiverLimits()
        self.inflight_bytes = 0  # tcp payload buffers held now
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self._expected: dict[str, _Expected] = {}
        self._receiving: dict[str, Inbox] = {}

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        if self._server is not None:
            raise RuntimeError("the receiver is already started")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Inbox(self._accept, self.limits.timeout_s), host, port)

    @property
    def address(self) -> str:
        """"host:port" of the bound socket."""
        if self._server is None:
            raise RuntimeError("the receiver is not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    # -- expectations ----------------------------------------------------------------------

    def expect(self, request_id: str, token: str, max_nbytes: int) -> None:
        """Take one transfer of ``request_id`` that carries ``token`` and at most ``max_nbytes``
        payload bytes. ValueError for an empty token or a request already expected or arriving."""
        if not token:
            raise ValueError("a transfer token must not be empty")
        if request_id in self._expected or request_id in self._receiving:
            raise ValueError(f"a transfer of {request_id!r} is already expected")
        self._expected[request_id] = _Expected(token, max_nbytes)

    def forget(self, request_id: str) -> None:
        """No transfer of ``request_id`` any more: one not arrived yet is refused, one being
        received or handled is dropped (its connection closed, its buffer freed; its sender
        gets `TransferError`). A no-op for a request not expected."""
        self._expected.pop(request_id, None)
        inbox = self._receiving.pop(request_id, None)
        if inbox is not None:
            log.info("dropping the KV transfer of %r: its request is gone", request_id)
            inbox.drop()

    @property
    def num_expected(self) -> int:
        return len(self._expected)

    @property
    def num_receiving(self) -> int:
        return len(self._receiving)

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

    # -- one connection --------------------------------------------------------------------

    def _accept(self, inbox: Inbox) -> None:
        if len(self._connections) >= self.limits.max_connections:
            log.warning("KV receiver: %d connections open already; closing a new one",
                        len(self._connections))
            inbox.drop()
            return
        task = asyncio.get_running_loop().create_task(self._serve(inbox))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _serve(self, inbox: Inbox) -> None:
        try:
            try:
                ack = await self._receive(inbox)
            except Exception as e:
                log.exception("KV receiver failed on a transfer")
                ack = TransferAck(request_id="", ok=False, code="error", message=repr(e))
            inbox.write(encode(ack))  # not once dropped
        finally:
            inbox.close()  # after the ack is flushed

    async def _receive(self, inbox: Inbox) -> TransferAck:
        try:
            async with asyncio.timeout(self.limits.header_timeout_s):
                header = await read_message(inbox, TransferHeader, max_len=self.limits.max_header_bytes)
        except (TruncatedError, TimeoutError) as e:
            return _refusal("", "truncated", f"header: {e!r}")
        except CodecError as e:
            return _refusal("", "bad_header", str(e))
        rid = header.request_id
        if (problem := self._check(header)) is not None:
            return _refusal(rid, *problem)
        del self._expected[rid]  # claimed: one transfer per expectation
        self._receiving[rid] = inbox
        reserved = header.nbytes if header.transport == "tcp" else 0
        self.inflight_bytes += reserved
        try:
            ack = await (self._receive_tcp(inbox, header) if header.transport == "tcp"
                         else self._receive_shm(header))
        finally:
            self.inflight_bytes -= reserved
            if self._receiving.get(rid) is inbox:
                del self._receiving[rid]
        if inbox.dropped:
            return _refusal(rid, "unknown_request", "the request was cancelled during its transfer")
        return ack

    async def _receive_tcp(self, inbox: Inbox, header: TransferHeader) -> TransferAck:
        payload = bytearray(header.nbytes)
        try:
            received = await inbox.readinto(memoryview(payload))
        except TimeoutError as e:
            return _refusal(header.request_id, "truncated", f"payload: {e}")
        if received < header.nbytes:
            if inbox.dropped:  # forgotten mid-payload: _receive says so
                return TransferAck(request_id=header.request_id, ok=False, code="unknown_request")
            return _refusal(header.request_id, "truncated",
                            f"stream ended after {received} of {header.nbytes} payload bytes")
        return await self._deliver(header, memoryview(payload))

    async def _receive_shm(self, header: TransferHeader) -> TransferAck:
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
        """Why ``header`` is refused (code, message), or None: checked from the header alone."""
        expected = self._expected.get(header.request_id)
        if expected is None or not hmac.compare_digest(header.token.encode(), expected.token.encode()):
            return "unknown_request", "no transfer of this request with this token is expected here"
        if self.model_identity is not None and header.model_identity != self.model_identity:
            return "model_mismatch", (f"receiver holds {self.model_identity!r}, the KV is for "
                                      f"{header.model_identity!r}")
        if header.transport == "shm" and header.shm_name is None:
            return "bad_header", "an shm transfer without shm_name"
        if header.nbytes != header.expected_nbytes:
            return "bad_header", (f"nbytes {header.nbytes} != {header.dtype}{header.shape} = "
                                  f"{header.expected_nbytes}")
        limit = min(expected.max_nbytes, self.limits.max_nbytes)
        if header.nbytes > limit:
            return "bad_header", f"nbytes {header.nbytes} over the {limit}-byte limit of this transfer"
        if header.transport == "tcp" and self.inflight_bytes + header.nbytes > self.limits.max_inflight_bytes:
            return "no_capacity", (f"{self.inflight_bytes} payload bytes in flight here; {header.nbytes} more "
                                   f"would pass the {self.limits.max_inflight_bytes}-byte limit")
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
