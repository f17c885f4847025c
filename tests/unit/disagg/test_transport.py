"""The KV transport contract, run against both senders (tcp, shm) and one real receiver on
loopback: payloads arrive bit-exactly, and bad transfers never reach the handler."""

import asyncio
import logging
import socket
import time

import pytest

from cloud_tier.disagg.messages import (
    TransferAck,
    encode,
    payload_checksum,
)
from cloud_tier.disagg.transport import (
    KVReceiver,
    ReceiverLimits,
    ShmSender,
    TcpSender,
    TransferError,
    tensor_payload,
)
from tests.unit.disagg.transport_helpers import (
    DTYPES,
    SENDERS,
    Sink,
    StallingTcpSender,
    corrupting,
    header_for,
    ids,
    kv,
    raw_transfer,
    receiving,
    refusals,
    same_bits,
    token_of,
    until,
)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sender_cls", SENDERS, ids=ids)
def test_transport_moves_kv_blocks_bit_exactly(sender_cls, dtype):
    t = kv(dtype)

    async def go():
        sink = Sink()
        async with receiving(sink, model_identity="smollm2-135m") as receiver:
            ack = await sender_cls().send(receiver.address, header_for(t), tensor_payload(t))
        return ack, sink

    ack, sink = asyncio.run(go())
    assert ack == TransferAck(request_id="req-1", ok=True)
    assert same_bits(sink.tensors["req-1"], t)
    got = sink.headers[0]
    assert (got.transport, got.nbytes, got.checksum) == (
        sender_cls.transport, t.numel() * t.element_size(), payload_checksum(tensor_payload(t)))
    assert got.record == header_for(t).record


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("sender_cls", SENDERS, ids=ids)
def test_one_receiver_serves_many_transfers_at_once(sender_cls, loop):
    """Also on uvloop, as uvicorn runs the workers: it may ask a paused protocol for a buffer."""
    factory = pytest.importorskip("uvloop").new_event_loop if loop == "uvloop" else None
    tensors = {f"r{i}": kv(seed=i, shape=(2, 2, 8, 16, 2, 8)) for i in range(6)}

    async def go():
        sink = Sink()
        async with receiving(sink, expect=tensors) as receiver:
            acks = await asyncio.gather(*(
                sender_cls().send(receiver.address, header_for(t, rid), tensor_payload(t))
                for rid, t in tensors.items()))
        return acks, sink

    with asyncio.Runner(loop_factory=factory) as runner:
        acks, sink = runner.run(go())
    assert all(a.ok for a in acks) and [a.request_id for a in acks] == list(tensors)
    assert all(same_bits(sink.tensors[rid], t) for rid, t in tensors.items())


@pytest.mark.parametrize("sender_cls", SENDERS, ids=ids)
def test_kv_of_another_model_is_refused_and_never_reaches_the_handler(sender_cls):
    t = kv(shape=(4, 2, 64, 16, 4, 64))  # 8 MiB: a tcp sender is still writing when refused

    async def go():
        sink = Sink()
        async with receiving(sink, model_identity="smollm2-135m") as receiver:
            ack = await sender_cls().send(receiver.address, header_for(t, model="qwen-0.5b"),
                                          tensor_payload(t))
        return ack, sink

    ack, sink = asyncio.run(go())
    assert (ack.ok, ack.code, ack.request_id) == (False, "model_mismatch", "req-1")
    assert "qwen-0.5b" in ack.message and sink.headers == []


@pytest.mark.parametrize("reply", [dict(code="no_capacity", message="3 blocks free, 24 needed"),
                                   dict(code="unknown_request", message="nobody waits for req-1")],
                         ids=lambda r: r["code"])
@pytest.mark.parametrize("sender_cls", SENDERS, ids=ids)
def test_the_handlers_refusal_reaches_the_sender(sender_cls, reply):
    t = kv()

    async def go():
        async with receiving(Sink(reply)) as receiver:
            return await sender_cls().send(receiver.address, header_for(t), tensor_payload(t))

    assert asyncio.run(go()) == TransferAck(request_id="req-1", ok=False, **reply)


@pytest.mark.parametrize("sender_cls", SENDERS, ids=ids)
def test_a_failing_handler_is_acked_as_error(sender_cls, caplog):
    async def broken(header, payload):
        raise RuntimeError("engine is shutting down")

    async def go():
        async with receiving(broken) as receiver:
            return await sender_cls().send(receiver.address, header_for(kv()), tensor_payload(kv()))

    ack = asyncio.run(go())
    assert (ack.ok, ack.code) == (False, "error") and "engine is shutting down" in ack.message
    assert "KV handler failed" in caplog.text


@pytest.mark.parametrize("sender_cls", SENDERS, ids=ids)
def test_a_corrupted_payload_is_acked_corrupt_and_never_reaches_the_handler(sender_cls):
    t = kv()

    async def go():
        sink = Sink()
        async with receiving(sink) as receiver:
            ack = await corrupting(sender_cls)().send(receiver.address, header_for(t), tensor_payload(t))
        return ack, sink

    ack, sink = asyncio.run(go())
    assert (ack.ok, ack.code) == (False, "corrupt") and sink.headers == []


def test_a_truncated_tcp_transfer_never_reaches_the_handler_and_the_receiver_goes_on(caplog):
    caplog.set_level(logging.WARNING, logger="cloud_tier.disagg.transport")
    t = kv()
    payload = bytes(tensor_payload(t))
    header = header_for(t).model_copy(update=dict(nbytes=len(payload), checksum=payload_checksum(payload)))

    async def go():
        sink = Sink()
        async with receiving(sink, expect=("req-1", "req-1b", "req-2")) as receiver:
            half_closed = await raw_transfer(receiver.address, encode(header), payload[: len(payload) // 2])
            again = header.model_copy(update=dict(request_id="req-1b", token=token_of("req-1b")))
            await raw_transfer(receiver.address, encode(again), payload[:100], half_close=False)
            await raw_transfer(receiver.address, encode(header)[:20], b"", half_close=False)
            # each of the three is settled, refused or (wrongly) handed to the handler: now it counts
            await until(lambda: refusals(caplog, "truncated") + len(sink.headers) == 3,
                        "the receiver to settle the three truncated transfers")
            assert sink.headers == [] and refusals(caplog, "truncated") == 3
            ack = await TcpSender().send(receiver.address, header_for(t, "req-2"), tensor_payload(t))
        return half_closed, ack, sink

    half_closed, ack, sink = asyncio.run(go())
    assert (half_closed.ok, half_closed.code, half_closed.request_id) == (False, "truncated", "req-1")
    assert ack.ok and [h.request_id for h in sink.headers] == ["req-2"]
    assert same_bits(sink.tensors["req-2"], t)


@pytest.mark.parametrize("header_bytes, match", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad magic"),
    (encode(TransferAck(request_id="r", ok=True)), "expected a TransferHeader"),
    (encode(header_for(kv()).model_copy(update=dict(nbytes=10))), "nbytes 10 !="),
    (encode(header_for(kv()).model_copy(update=dict(transport="shm", shm_name="cascade-kv-0000",
                                                    nbytes=kv().numel() * 4))),
     "shm segment"),
    (encode(header_for(kv()).model_copy(update=dict(transport="shm", nbytes=kv().numel() * 4))),
     "without shm_name"),
], ids=["not-ckv", "not-a-header", "nbytes-vs-shape", "no-such-segment", "no-segment-name"])
def test_a_bad_header_is_acked_bad_header(header_bytes, match):
    async def go():
        sink = Sink()
        async with receiving(sink) as receiver:
            ack = await raw_transfer(receiver.address, header_bytes, b"")
        return ack, sink

    ack, sink = asyncio.run(go())
    assert (ack.ok, ack.code) == (False, "bad_header") and match in ack.message
    assert sink.headers == []


@pytest.mark.parametrize("sender_cls", SENDERS, ids=ids)
def test_a_payload_over_the_receivers_limit_is_refused(sender_cls):
    t = kv()

    async def go():
        async with receiving(Sink(), limits=ReceiverLimits(max_nbytes=1024)) as receiver:
            return await sender_cls().send(receiver.address, header_for(t), tensor_payload(t))

    ack = asyncio.run(go())
    assert (ack.ok, ack.code) == (False, "bad_header") and "1024-byte limit" in ack.message


@pytest.mark.parametrize("sender_cls", SENDERS, ids=ids)
def test_no_receiver_listening_is_a_transfer_error_at_once(sender_cls):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
        started = time.monotonic()
        with pytest.raises(TransferError, match="cannot reach"):
            asyncio.run(sender_cls(timeout_s=5).send(address, header_for(kv()), tensor_payload(kv())))
    assert time.monotonic() - started < 1


@pytest.mark.parametrize("sender_cls", SENDERS, ids=ids)
def test_a_receiver_that_never_acks_is_a_transfer_error_after_the_timeout(sender_cls):
    async def swallow(reader, writer):
        await reader.read()  # takes everything, answers nothing

    async def go():
        server = await asyncio.start_server(swallow, "127.0.0.1", 0)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            started = time.monotonic()
            with pytest.raises(TransferError, match="no ack"):
                await sender_cls(timeout_s=0.3).send(address, header_for(kv()), tensor_payload(kv()))
            return time.monotonic() - started
        finally:
            server.close()

    assert 0.3 <= asyncio.run(go()) < 2


def test_a_receiver_that_takes_no_payload_is_a_transfer_error_after_the_timeout():
    t = kv(shape=(4, 2, 64, 16, 4, 64))  # 8 MiB: more than the socket buffers hold

    async def go():
        server = await asyncio.start_server(lambda r, w: asyncio.sleep(5), "127.0.0.1", 0)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            with pytest.raises(TransferError, match="took no payload"):
                await TcpSender(timeout_s=0.3).send(address, header_for(t), tensor_payload(t))
        finally:
            server.close()

    asyncio.run(go())


@pytest.mark.parametrize("sender_cls, stall", [(StallingTcpSender, "mid-payload"), (TcpSender, "awaiting-ack"),
                                               (ShmSender, "awaiting-ack")],
                         ids=["tcp-mid-payload", "tcp-awaiting-ack", "shm-awaiting-ack"])
def test_closing_the_receiver_aborts_a_stalled_sender(sender_cls, stall):
    """A sender stalled half way through its payload, or waiting for an ack the handler never gives:
    closing the receiver ends its transfer at once with TransferError (its own timeout is 30 s)."""
    t = kv()

    async def go():
        sink, in_handler = Sink(), asyncio.Event()

        async def handler(header, payload):
            if header.request_id == "stuck":
                in_handler.set()
                await asyncio.get_running_loop().create_future()  # never answers
            return await sink(header, payload)

        receiver = KVReceiver(handler)
        await receiver.start()
        for rid in ("stuck", "marker"):
            receiver.expect(rid, token_of(rid), t.nbytes)
        try:
            sender = sender_cls(timeout_s=30)
            sending = asyncio.create_task(sender.send(receiver.address, header_for(t, "stuck"), tensor_payload(t)))
            if stall == "mid-payload":
                await asyncio.wait_for(sender.stalled.wait(), 5)
                # a later transfer is served, so the receiver has taken up the stalled one before it
                marker = await TcpSender().send(receiver.address, header_for(t, "marker"), tensor_payload(t))
                assert marker.ok
            else:
                await asyncio.wait_for(in_handler.wait(), 5)
            assert not sending.done()  # stalled mid-transfer
            await asyncio.wait_for(receiver.close(), 2)
            with pytest.raises(TransferError, match="no valid ack"):  # not "no ack within 30s"
                await asyncio.wait_for(sending, 2)
        finally:
            await receiver.close()
        return sink

    sink = asyncio.run(go())
    assert [h.request_id for h in sink.headers] == (["marker"] if stall == "mid-payload" else [])
