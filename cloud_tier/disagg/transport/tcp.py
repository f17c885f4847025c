"""``tcp``: the header frame then the raw payload, on one connection per transfer."""

from __future__ import annotations

import asyncio

from cloud_tier.disagg.messages import TransferAck, TransferHeader, encode, read_message
from cloud_tier.disagg.transport.base import CHUNK, KVSender, TransferError, _close


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
