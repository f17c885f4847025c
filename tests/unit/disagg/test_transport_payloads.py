"""The KV transport's shared-memory hygiene (no leaked segments, no resource-tracker warnings,
a full /dev/shm), large transfers, and tensors <-> payload bytes."""

import asyncio
import errno
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from cloud_tier.disagg.transport import (
    ShmSender,
    TcpSender,
    TransferError,
    payload_to_tensor,
    tensor_payload,
)
from tests.unit.disagg.transport_helpers import (
    DTYPES,
    REPO,
    SENDERS,
    SHM,
    Sink,
    corrupting,
    header_for,
    ids,
    kv,
    receiving,
    same_bits,
    segments,
)


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_shm_leaves_no_segment_after_success_or_failure():
    t = kv()

    async def go():
        async with receiving(Sink(), ("ok", "other-model", "corrupt"), model_identity="smollm2-135m") as receiver:
            assert (await ShmSender().send(receiver.address, header_for(t, "ok"), tensor_payload(t))).ok
            assert segments() == set()
            bad = await ShmSender().send(receiver.address, header_for(t, "other-model", model="other"),
                                         tensor_payload(t))
            assert bad.code == "model_mismatch" and segments() == set()
            corrupt = await corrupting(ShmSender)().send(receiver.address, header_for(t, "corrupt"),
                                                         tensor_payload(t))
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
            header = TransferHeader(request_id=rid, token="t-" + rid, model_identity="m", dtype="float16", shape=[8192],
                                    nbytes=0, checksum="", transport="shm", record=rec)
            ack = await ShmSender(timeout_s=5).send(address, header, bytes(range(256)) * 64)
            print(rid, ack.ok, ack.code, flush=True)

    async def main(mode):
        if mode == "send":
            return await send(sys.argv[2])
        receiver = KVReceiver(handler)
        await receiver.start()
        for rid in ("ok", "refused"):
            receiver.expect(rid, "t-" + rid, 1 << 20)
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
