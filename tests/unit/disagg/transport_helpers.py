"""What the KV transport tests share: payloads, headers, a recording handler, a receiver on
loopback, raw transfers written by hand, and senders that stall or corrupt on purpose."""

import asyncio
import contextlib
from pathlib import Path

import torch

from cloud_tier.disagg.messages import (
    RequestRecord,
    TransferAck,
    TransferHeader,
    read_message,
)
from cloud_tier.disagg.transport import (
    KVReceiver,
    ShmSender,
    TcpSender,
    payload_to_tensor,
)

REPO = Path(__file__).resolve().parents[3]
SHM = Path("/dev/shm")
SENDERS = [TcpSender, ShmSender]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ids = lambda cls: cls.transport  # noqa: E731


def segments() -> set[str]:
    return {p.name for p in SHM.glob("cascade-kv-*")} if SHM.is_dir() else set()


def kv(dtype=torch.float32, shape=(2, 2, 3, 4, 2, 8), seed=0) -> torch.Tensor:
    """Random KV blocks (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), with
    the values that a float compare would miss: NaN, +-inf, -0.0."""
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    t.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    return t


def token_of(request_id: str) -> str:
    """The transfer token the tests' receivers expect for ``request_id``."""
    return f"token-of-{request_id}"


def header_for(t: torch.Tensor, request_id="req-1", model="smollm2-135m", token=None) -> TransferHeader:
    rec = RequestRecord(request_id=request_id, prompt_token_ids=[5, 6, 7], output_token_ids=[9],
                        sampling={"temperature": 0.0, "max_tokens": 8})
    return TransferHeader(request_id=request_id, token=token_of(request_id) if token is None else token,
                          model_identity=model,
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
async def receiving(handler, expect=("req-1",), **kw):
    """A started receiver that expects one transfer of each request in ``expect``, with its
    `token_of`, up to the receiver's own byte limit."""
    receiver = KVReceiver(handler, **kw)
    await receiver.start()
    for rid in expect:
        receiver.expect(rid, token_of(rid), receiver.limits.max_nbytes)
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


async def until(predicate, what: str, timeout_s: float = 5.0) -> None:
    """Wait, polling, for a positive sign that the receiver got somewhere; fail after ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}") from None


def refusals(caplog, code: str) -> int:
    """How many transfers the receiver has refused with ``code`` (it logs each)."""
    return sum(r.getMessage().startswith("refused KV transfer") and f": {code}: " in r.getMessage()
               for r in caplog.records)


class StallingTcpSender(TcpSender):
    """A tcp sender that stops half way through the payload and sends nothing more, ever."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.stalled = asyncio.Event()

    async def _write(self, writer, frame, payload):
        writer.write(frame)
        writer.write(payload[:payload.nbytes // 2])
        await writer.drain()
        self.stalled.set()
        await asyncio.get_running_loop().create_future()  # until the transfer ends and cancels it


def corrupting(sender_cls):
    """A sender that flips one payload bit after the checksum went into the header."""

    class Corrupting(sender_cls):
        async def _send(self, address, header, payload):
            bad = bytearray(payload)
            bad[len(bad) // 2] ^= 0x01
            return await super()._send(address, header, memoryview(bad))

    return Corrupting
