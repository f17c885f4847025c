"""``shm`` (same host): the payload is copied once into a POSIX shared-memory segment that the
sender owns and always unlinks; only the header crosses TCP. The segments are created and
mapped with ``_posixshmem`` and ``mmap`` directly, not ``multiprocessing.shared_memory``, whose
resource tracker in Python 3.11 unlinks (and warns about) segments another process owns."""

from __future__ import annotations

import _posixshmem
import asyncio
import mmap
import os
import uuid
from multiprocessing import resource_tracker

from cloud_tier.disagg.messages import TransferAck, TransferHeader, encode, read_message
from cloud_tier.disagg.transport.base import KVSender, TransferError, _close


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
