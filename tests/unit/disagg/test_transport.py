"""The KV transport contract, run against both senders (tcp, shm) and one real receiver on
loopback: payloads arrive bit-exactly, and bad transfers never reach the handler."""

import asyncio
import contextlib
import errno
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from cloud_tier.disagg.messages import (
    RequestRecord,
    TransferAck,
    TransferHeader,
    encode,
    payload_checksum,
    read_message,
)
from cloud_tier.disagg.transport import (
    KVReceiver,
    ShmSender,
    TcpSender,
    TransferError,
    payload_to_tensor,
    tensor_payload,
)

REPO = Path(__file__).resolve().parents[3]
SHM = Path("/dev/shm")
SENDERS = [TcpSender, ShmSender]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ids = lambda cls: cls.transport  # noqa: E731


def segments() -> set[str]:
    return {p.name for p in SHM.glob("cascade-kv-*")} if SHM.is_dir() else set()


@pytest.fixture(autouse=True)
def no_segment_outlives_a_test():
    before = segments()
    yield
    assert segments() - before == set()


def kv(dtype=torch.float32, shape=(2, 2, 3, 4, 2, 8), seed=0) -> torch.Tensor:
    """Random KV blocks (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), with
    the values that a float compare would miss: NaN, +-inf, -0.0."""
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    t.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    return t


def header_for(t: torch.Tensor, request_id="req-1", model="smollm2-135m") -> TransferHeader:
    rec = RequestRecord(request_id=request_id, prompt_token_ids=[5, 6, 7], output_token_ids=[9],
                        sampling={"temperature": 0.0, "max_tokens": 8})
    return TransferHeader(request_id=request_id, model_identity=model,
                          dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                          nbytes=0, checksum="", transport="tcp", record=rec)  # the sender fills these


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class Sink:
    """A handler that copies each payload out, as a decode worker must, then answers ``reply``."""

    def __init__(self, reply: dict | None = None):
        self.reply = reply or {}
        self.headers: list[TransferHeader] = []
        self.tensors: dict[str, torch.Tensor] = {}

    async def __call__(self, header: TransferHeader, payload: memoryview) -> TransferAck:
        self.headers.append(header)
        self.tensors[header.request_id] = payload_to_tensor(header, payload).clone()
        return TransferAck(request_id=header.request_id, ok=not self.reply, **self.reply)


@contextlib.asynccontextmanager
async def receiving(handler, **kw):
    receiver = KVReceiver(handler, **kw)
    await receiver.start()
    try:
        yield receiver
    finally:
        await receiver.close()


async def raw_transfer(address: str, header_bytes: bytes, payload: bytes,
                       half_close=True) -> TransferAck | None:
    """Talk to a receiver by hand: write what is given, end the stream, return its ack if any."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(header_bytes + payload)
    await writer.drain()
    try:
        if not half_close:
            return None
        writer.write_eof()
        return await asyncio.wait_for(read_message(reader, TransferAck), 5)
    finally:
        writer.close()


def corrupting(sender_cls):
    """A sender that flips one payload bit after the checksum went into the header."""

    class Corrupting(sender_cls):
        async def _send(self, address, header, payload):
            bad = bytearray(payload)
            bad[len(bad) // 2] ^= 0x01
            return await super()._send(address, header, memoryview(bad))

    return Corrupting


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
        async with receiving(sink) as receiver:
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


def test_a_truncated_tcp_transfer_never_reaches_the_handler_and_the_receiver_goes_on():
    t = kv()
    payload = bytes(tensor_payload(t))
    header = header_for(t).model_copy(update=dict(nbytes=len(payload), checksum=payload_checksum(payload)))

    async def go():
        sink = Sink()
        async with receiving(sink) as receiver:
            half_closed = await raw_transfer(receiver.address, encode(header), payload[: len(payload) // 2])
            await raw_transfer(receiver.address, encode(header), payload[:100], half_close=False)
            await raw_transfer(receiver.address, encode(header)[:20], b"", half_close=False)
            await asyncio.sleep(0.05)  # let the receiver see the aborted connections
            assert sink.headers == []
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
        async with receiving(Sink(), max_nbytes=1024) as receiver:
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


def test_closing_the_receiver_aborts_a_stalled_sender():
    async def go():
        receiver = KVReceiver(Sink())
        await receiver.start()
        host, port = receiver.address.rsplit(":", 1)
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"CKV1")  # and then nothing
        await asyncio.sleep(0.05)
        await asyncio.wait_for(receiver.close(), 2)
        writer.close()

    asyncio.run(go())


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_shm_leaves_no_segment_after_success_or_failure():
    t = kv()

    async def go():
        async with receiving(Sink(), model_identity="smollm2-135m") as receiver:
            assert (await ShmSender().send(receiver.address, header_for(t), tensor_payload(t))).ok
            assert segments() == set()
            bad = await ShmSender().send(receiver.address, header_for(t, model="other"), tensor_payload(t))
            assert bad.code == "model_mismatch" and segments() == set()
            corrupt = await corrupting(ShmSender)().send(receiver.address, header_for(t), tensor_payload(t))
            assert corrupt.code == "corrupt" and segments() == set()

    asyncio.run(go())


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_a_full_dev_shm_is_a_transfer_error_not_a_crash(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)

    async def go():
        sink = Sink()
        async with receiving(sink) as receiver:
            with pytest.raises(TransferError, match="cannot stage .* No space left"):
                await ShmSender().send(receiver.address, header_for(kv()), tensor_payload(kv()))
        return sink

    assert asyncio.run(go()).headers == []  # and the autouse fixture sees no segment left


SHM_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from cloud_tier.disagg.messages import RequestRecord, TransferAck, TransferHeader
    from cloud_tier.disagg.transport import KVReceiver, ShmSender

    async def handler(header, payload):
        if bytes(payload) != bytes(range(256)) * 64:
            return TransferAck(request_id=header.request_id, ok=False, code="corrupt")
        if header.request_id == "refused":
            return TransferAck(request_id=header.request_id, ok=False, code="no_capacity")
        return TransferAck(request_id=header.request_id, ok=True)

    async def send(address):
        for rid in ("ok", "refused"):
            rec = RequestRecord(request_id=rid, prompt_token_ids=[1], sampling={})
            header = TransferHeader(request_id=rid, model_identity="m", dtype="float16", shape=[8192],
                                    nbytes=0, checksum="", transport="shm", record=rec)
            ack = await ShmSender(timeout_s=5).send(address, header, bytes(range(256)) * 64)
            print(rid, ack.ok, ack.code, flush=True)

    async def main(mode):
        if mode == "send":
            return await send(sys.argv[2])
        receiver = KVReceiver(handler)
        await receiver.start()
        if mode == "both":
            await send(receiver.address)
        else:
            print(receiver.address, flush=True)
            await asyncio.to_thread(sys.stdin.read)
        await receiver.close()

    asyncio.run(main(sys.argv[1]))
""")


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_shm_transfers_leave_no_resource_tracker_warnings_in_either_process(tmp_path):
    """Python 3.11's resource tracker warns of "leaked shared_memory" (and unlinks the segment)
    for every segment a process attached but did not unlink, and fails on a double unregister
    when a sender and receiver share it. Both layouts must run silent."""
    script = tmp_path / "shm_peer.py"
    script.write_text(SHM_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def peer(*args, **kw):
        return subprocess.Popen([sys.executable, str(script), *args], cwd=REPO, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)

    both = peer("both")
    receiver = peer("receive", stdin=subprocess.PIPE)
    address = receiver.stdout.readline().strip()
    sender_out, sender_err = peer("send", address).communicate(timeout=30)
    receiver_out, receiver_err = receiver.communicate("", timeout=30)  # EOF on stdin: close
    both_out, both_err = both.communicate(timeout=30)

    expected = "ok True \nrefused False no_capacity\n"
    assert (sender_out, both_out) == (expected, expected)
    assert (sender_err, receiver_err, both_err) == ("", "", "")
    assert receiver.returncode == both.returncode == 0


@pytest.mark.parametrize("sender_cls", SENDERS, ids=ids)
def test_a_64_mib_transfer_completes(sender_cls):
    t = torch.randn(16, 1024, 1024, generator=torch.Generator().manual_seed(1))  # 64 MiB of float32

    async def go():
        sink = Sink()
        async with receiving(sink) as receiver:
            started = time.perf_counter()
            ack = await sender_cls().send(receiver.address, header_for(t), tensor_payload(t))
            return ack, sink, time.perf_counter() - started

    ack, sink, seconds = asyncio.run(go())
    assert ack.ok and same_bits(sink.tensors["req-1"], t)
    mib = t.numel() * t.element_size() / (1 << 20)
    print(f"\n[{sender_cls.transport}] {mib:.0f} MiB in {seconds * 1e3:.0f} ms: {mib / seconds:.0f} MiB/s "
          "(send() to ack, both ends in one process, the handler copying the KV out)")


def test_tensor_payload_shares_memory_and_round_trips_every_dtype():
    for dtype in DTYPES:
        t = kv(dtype)
        view = tensor_payload(t)
        assert view.nbytes == t.numel() * t.element_size()
        t.view(-1)[-1] = 3.0  # no copy: the view sees the write
        header = header_for(t).model_copy(update=dict(nbytes=view.nbytes))
        assert same_bits(payload_to_tensor(header, memoryview(bytearray(view))), t)
    empty = torch.empty(0, 2, 1, 16, 2, 8, dtype=torch.bfloat16)
    assert tensor_payload(empty).nbytes == 0
    assert payload_to_tensor(header_for(empty), memoryview(b"")).shape == empty.shape


def test_tensor_payload_refuses_what_is_not_one_cpu_buffer():
    with pytest.raises(ValueError, match="contiguous"):
        tensor_payload(kv().transpose(0, 1))
    with pytest.raises(ValueError, match="header says"):
        payload_to_tensor(header_for(kv()), memoryview(b"123"))


def test_a_payload_that_does_not_match_its_header_is_not_sent():
    with pytest.raises(ValueError, match="payload is 12 bytes"):
        asyncio.run(TcpSender().send("127.0.0.1:1", header_for(kv()), b"x" * 12))
