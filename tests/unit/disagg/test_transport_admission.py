"""The KV receiver's door: it takes only the transfers it was told to expect (request id, token,
a cap on the bytes), decides from the header alone before it allocates anything, caps the
connections and the payload bytes in flight, and drops a transfer whose request is forgotten."""

import asyncio
import logging
import socket
import struct
import tracemalloc

import pytest

from cloud_tier.disagg.messages import MAGIC, TransferAck, decode, encode, payload_checksum
from cloud_tier.disagg.transport import ReceiverLimits, ShmSender, TcpSender, TransferError, tensor_payload
from tests.unit.disagg.transport_helpers import (
    SENDERS,
    Sink,
    StallingTcpSender,
    header_for,
    ids,
    kv,
    receiving,
    token_of,
    until,
)

GIB = 1 << 30


def huge_header(request_id="req-1", token=None, nbytes=GIB) -> bytes:
    """A well-formed header frame announcing ``nbytes`` of float32 KV that will never come."""
    h = header_for(kv(), request_id, token=token)
    return encode(h.model_copy(update=dict(shape=[nbytes // 4], nbytes=nbytes, checksum="00000000")))


async def header_only(address: str, frame: bytes, timeout_s: float = 2.0) -> TransferAck:
    """Send ``frame`` and nothing more, keeping the connection open; the receiver's ack, read to
    the end of the stream (so the receiver has closed it)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(frame)
        await writer.drain()
        return decode(await asyncio.wait_for(reader.read(), timeout_s))
    finally:
        writer.close()


def peak_allocation(coro) -> tuple[object, int]:
    """``coro``'s result and the most Python memory allocated at once while it ran."""
    tracemalloc.start()
    try:
        result = asyncio.run(coro)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("frame, code", [
    (huge_header("nobody-expects-me"), "unknown_request"),
    (huge_header(token="a-guess"), "unknown_request"),
    (huge_header(token=""), "unknown_request"),
    (huge_header(nbytes=GIB - 4), "bad_header"),  # the right token, more than the request's blocks can be
], ids=["unknown-request", "wrong-token", "no-token", "over-its-cap"])
def test_a_transfer_not_expected_so_is_refused_from_its_header_with_nothing_allocated(frame, code):
    async def go():
        sink = Sink()
        async with receiving(sink, expect=()) as receiver:
            receiver.expect("req-1", token_of("req-1"), 64 << 20)
            ack = await header_only(receiver.address, frame)
            return ack, sink, receiver.inflight_bytes

    (ack, sink, inflight), peak = peak_allocation(go())
    assert (ack.ok, ack.code) == (False, code) and sink.headers == [] and inflight == 0
    assert peak < 8 << 20  # of the 1 GiB the header announced


def test_a_refused_header_is_logged(caplog):
    caplog.set_level(logging.WARNING, logger="cloud_tier.disagg.transport")

    async def go():
        async with receiving(Sink()) as receiver:
            return await header_only(receiver.address, huge_header(token="a-guess"))

    assert asyncio.run(go()).code == "unknown_request"
    assert "refused KV transfer 'req-1': unknown_request" in caplog.text


@pytest.mark.parametrize("sender_cls", SENDERS, ids=ids)
def test_an_expectation_admits_one_transfer_and_a_wrong_token_does_not_spend_it(sender_cls):
    t = kv()

    async def go():
        sink = Sink()
        async with receiving(sink) as receiver:
            guessed = await sender_cls().send(receiver.address, header_for(t, token="a-guess"), tensor_payload(t))
            first = await sender_cls().send(receiver.address, header_for(t), tensor_payload(t))
            again = await sender_cls().send(receiver.address, header_for(t), tensor_payload(t))
            return [(a.ok, a.code) for a in (guessed, first, again)], sink, receiver.num_expected

    acks, sink, expected = asyncio.run(go())
    assert acks == [(False, "unknown_request"), (True, ""), (False, "unknown_request")]
    assert [h.request_id for h in sink.headers] == ["req-1"] and expected == 0


def test_expect_refuses_an_empty_token_and_a_request_twice():
    async def go():
        async with receiving(Sink()) as receiver:
            with pytest.raises(ValueError, match="empty"):
                receiver.expect("req-2", "", 10)
            with pytest.raises(ValueError, match="already expected"):
                receiver.expect("req-1", "other", 10)

    asyncio.run(go())


@pytest.mark.parametrize("sender_cls", SENDERS, ids=ids)
def test_a_forgotten_request_is_refused(sender_cls):
    async def go():
        async with receiving(Sink()) as receiver:
            receiver.forget("req-1")
            receiver.forget("never-expected")  # a no-op
            return await sender_cls().send(receiver.address, header_for(kv()), tensor_payload(kv()))

    assert asyncio.run(go()).code == "unknown_request"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_forgetting_a_request_mid_payload_drops_its_transfer_and_frees_its_buffer(loop):
    """Also on uvloop, as uvicorn runs the workers."""
    factory = pytest.importorskip("uvloop").new_event_loop if loop == "uvloop" else None
    t = kv(shape=(4, 2, 64, 16, 4, 64))  # 8 MiB

    async def go():
        sink = Sink()
        async with receiving(sink) as receiver:
            sender = StallingTcpSender(timeout_s=30)
            sending = asyncio.create_task(sender.send(receiver.address, header_for(t), tensor_payload(t)))
            await until(lambda: receiver.num_receiving == 1, "the receiver to take the transfer up")
            assert receiver.inflight_bytes == t.nbytes
            receiver.forget("req-1")
            with pytest.raises(TransferError):
                await asyncio.wait_for(sending, 2)  # at once, not after its 30 s
            await until(lambda: receiver.inflight_bytes == 0, "the payload buffer to be freed")
            return sink, receiver.num_receiving, receiver.num_expected

    with asyncio.Runner(loop_factory=factory) as runner:
        sink, receiving_now, expected = runner.run(go())
    assert sink.headers == [] and receiving_now == expected == 0


def test_forgetting_a_request_while_its_handler_runs_sends_no_ack_of_it():
    t = kv()

    async def go():
        in_handler, release = asyncio.Event(), asyncio.Event()

        async def slow(header, payload):
            in_handler.set()
            await release.wait()
            return TransferAck(request_id=header.request_id, ok=True)

        async with receiving(slow) as receiver:
            sending = asyncio.create_task(TcpSender(timeout_s=30).send(receiver.address, header_for(t),
                                                                       tensor_payload(t)))
            await asyncio.wait_for(in_handler.wait(), 5)
            receiver.forget("req-1")
            release.set()
            with pytest.raises(TransferError):
                await asyncio.wait_for(sending, 2)

    asyncio.run(go())


def test_tcp_payload_bytes_in_flight_are_capped_and_shm_ones_are_not():
    t = kv(shape=(4, 2, 64, 16, 4, 64))  # 8 MiB

    async def go():
        sink = Sink()
        limits = ReceiverLimits(max_inflight_bytes=t.nbytes * 3 // 2)
        async with receiving(sink, expect=("stalled", "tcp", "shm", "later"), limits=limits) as receiver:
            stalled = StallingTcpSender(timeout_s=30)
            sending = asyncio.create_task(stalled.send(receiver.address, header_for(t, "stalled"), tensor_payload(t)))
            await until(lambda: receiver.num_receiving == 1, "the receiver to take the first transfer up")
            over = await TcpSender().send(receiver.address, header_for(t, "tcp"), tensor_payload(t))
            shm = await ShmSender().send(receiver.address, header_for(t, "shm"), tensor_payload(t))
            receiver.forget("stalled")
            with pytest.raises(TransferError):
                await sending
            later = await TcpSender().send(receiver.address, header_for(t, "later"), tensor_payload(t))
            return over, shm, later

    over, shm, later = asyncio.run(go())
    assert (over.ok, over.code) == (False, "no_capacity") and "in flight" in over.message
    assert shm.ok and later.ok


def test_connections_past_the_cap_are_closed_on_accept(caplog):
    caplog.set_level(logging.WARNING, logger="cloud_tier.disagg.transport")

    async def go():
        async with receiving(Sink(), limits=ReceiverLimits(max_connections=2)) as receiver:
            host, port = receiver.address.rsplit(":", 1)
            idle = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
            await until(lambda: len(receiver._connections) == 2, "the receiver to take both up")
            reader, writer = await asyncio.open_connection(host, int(port))
            closed_at_once = await asyncio.wait_for(reader.read(), 2) == b""
            writer.close()
            for _, w in idle:
                w.close()
            await until(lambda: not receiver._connections, "the idle connections to end")
            ack = await TcpSender().send(receiver.address, header_for(kv()), tensor_payload(kv()))
            return closed_at_once, ack

    closed_at_once, ack = asyncio.run(go())
    assert closed_at_once and ack.ok
    assert "2 connections open already" in caplog.text


def test_a_connection_that_sends_no_header_is_closed_after_the_header_timeout():
    async def go():
        async with receiving(Sink(), limits=ReceiverLimits(header_timeout_s=0.2)) as receiver:
            host, port = receiver.address.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=3) as s:
                s.sendall(MAGIC)  # a prefix begun, never finished
                return decode(await asyncio.to_thread(_read_to_end, s))

    ack = asyncio.run(go())
    assert (ack.ok, ack.code) == (False, "truncated")


@pytest.mark.parametrize("claimed", [(1 << 32) - 1, (4 << 20) - 1], ids=["over-the-limit", "under-the-limit"])
def test_a_header_frame_is_held_only_as_far_as_it_arrived(claimed):
    """A prefix that claims a huge header body: refused outright over the limit, and under it
    the receiver holds what came (a few bytes), not what was claimed, until the header timeout."""
    async def go():
        async with receiving(Sink(), limits=ReceiverLimits(header_timeout_s=0.3)) as receiver:
            # (over the limit, no body byte follows the prefix: unread bytes would make the close a reset)
            body = b'{"request_id"' if claimed < 4 << 20 else b""
            return await header_only(receiver.address, MAGIC + struct.pack(">BI", 2, claimed) + body)

    ack, peak = peak_allocation(go())
    assert not ack.ok and ack.code == ("bad_header" if claimed > 4 << 20 else "truncated")
    assert peak < 2 << 20


def test_receiver_limits_are_validated():
    for bad in (dict(max_nbytes=-1), dict(max_connections=0), dict(max_header_bytes=0), dict(timeout_s=0),
                dict(header_timeout_s=-1), dict(max_inflight_bytes=-1)):
        with pytest.raises(ValueError):
            ReceiverLimits(**bad)


def test_a_transfer_with_the_right_token_still_arrives_bit_exactly():
    t = kv()
    payload = bytes(tensor_payload(t))

    async def go():
        sink = Sink()
        async with receiving(sink) as receiver:
            header = header_for(t).model_copy(update=dict(nbytes=len(payload), checksum=payload_checksum(payload)))
            host, port = receiver.address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(encode(header) + payload)
            ack = decode(await asyncio.wait_for(reader.read(), 5))
            writer.close()
            return ack, sink

    ack, sink = asyncio.run(go())
    assert ack.ok and bytes(tensor_payload(sink.tensors["req-1"])) == payload


def _read_to_end(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data
