"""Group commit for the offline queue: concurrent enqueues from an event loop share transactions."""

from __future__ import annotations

import asyncio

from sync.queue import NewItem, OfflineQueue


class GroupCommit:
    """Concurrent enqueues from an event loop share transactions: while one commit (one fsync)
    runs, the items that arrive wait and go together in the next. Each caller is answered when
    the transaction holding its item has committed, so an acknowledgement still means durable."""

    def __init__(self, queue: OfflineQueue):
        self.queue = queue
        self._pending: list[tuple[NewItem, asyncio.Future]] = []
        self._writer: asyncio.Task | None = None

    async def put(self, item: NewItem) -> str | None:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((item, fut))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._drain())
        return await asyncio.shield(fut)  # a caller that gives up does not abort the others' commit

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                ids = await asyncio.to_thread(self.queue.enqueue_many, [item for item, _ in batch])
            except Exception:  # the batch is all or nothing: give each item its own answer, so one
                # bad item (a full queue, a reused key, a value SQLite refuses) fails only itself
                for item, fut in batch:
                    try:
                        (one,) = await asyncio.to_thread(self.queue.enqueue_many, [item])
                    except Exception as e:
                        _settle(fut, error=e)
                    else:
                        _settle(fut, one)
                continue
            for (_, fut), item_id in zip(batch, ids, strict=True):
                _settle(fut, item_id)


def _settle(fut: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
