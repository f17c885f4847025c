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
    waits on the ASGI receive channel for the disconnect (an event, not a poll)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise CallerGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
