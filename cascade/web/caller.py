"""Work that runs only while its caller is connected: an internal call whose caller (the
gateway, a decode worker) goes away is cancelled, not finished for nobody."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class CallerGone(Exception):
    """The caller closed its connection before the answer."""


async def while_connected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, unless the caller disconnects first: then ``work`` is cancelled, its
    cancellation awaited, and `CallerGone` raised. Call it once the request body is read: it
    waits on the ASGI receive channel for the disconnect (an event, not a poll).

    ``work`` runs in this task, which is cancelled when the caller leaves (work that enters a
    task-bound context, as httpx does with anyio's cancel scopes, must stay in one task), and
    the watcher starts on the loop's next turn: work done without waiting (a gateway cache hit)
    costs no task."""
    task = asyncio.current_task()
    watcher: asyncio.Task | None = None
    left = False

    def on_disconnect(w: asyncio.Task) -> None:
        nonlocal left
        if w is watcher and not w.cancelled() and w.exception() is None:
            left = True
            task.cancel()

    def watch() -> None:
        nonlocal watcher
        watcher = asyncio.ensure_future(_disconnected(request))
        watcher.add_done_callback(on_disconnect)

    start = asyncio.get_running_loop().call_soon(watch)
    try:
        result = await work
    except asyncio.CancelledError:
        if not left:
            raise
        task.uncancel()  # the cancellation was ours, and is answered here
        raise CallerGone() from None
    finally:
        start.cancel()
        if watcher is not None:
            w, watcher = watcher, None  # a disconnect seen from now on is not ours to answer
            w.cancel()
    if left:  # work that went on after its cancellation: its caller is gone all the same
        task.uncancel()
        raise CallerGone()
    return result


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
