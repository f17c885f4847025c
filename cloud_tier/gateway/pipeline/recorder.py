"""The event stream a flight is served from: recorded while it runs and settled when it closes
(``Recorder``), run to its end without its client when it has an Idempotency-Key (``RunToEnd``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from cloud_tier.gateway.pipeline.flight import Flight, observe_event


class Recorder:
    """Wraps a flight's event stream: records the events for the cache and idempotency store
    (``observe``: our workers' events or OpenAI chunks), and settles the flight when closed (read
    to the end, failed, or abandoned by the client)."""

    def __init__(self, events: AsyncIterator, flight: Flight, settle: Callable[[Flight], Awaitable[None]],
                 observe: Callable[[Flight, object], object] = observe_event):
        self._events = events
        self.flight = flight
        self._settle = settle
        self._observe = observe

    def __aiter__(self):
        return self

    async def __anext__(self):
        f = self.flight
        try:
            ev = await self._events.__anext__()
        except StopAsyncIteration:
            f.ended = True
            raise
        except asyncio.CancelledError:
            raise  # the client is gone: not a failure of the stream
        except Exception as e:
            f.error = e
            raise
        try:
            return self._observe(f, ev)
        except Exception as e:  # what the worker sent made no sense: its failure, not the client's
            f.error = e
            raise

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            if not self.flight.settled:
                self.flight.settled = True
                # shielded: a close cancelled midway (its client gone) still settles the flight to its end
                await asyncio.shield(asyncio.ensure_future(self._settle(self.flight)))


_END = object()
_detached: set[asyncio.Task] = set()


class RunToEnd:
    """A flight with an Idempotency-Key runs to its end even when its client goes away: its result
    is stored, and the client's retry (same key) is answered from it instead of running twice.
    The flight is read by a task of its own; the client reads what it has passed on."""

    def __init__(self, events: Recorder):
        self._events: asyncio.Queue = asyncio.Queue()
        task = asyncio.get_running_loop().create_task(self._pump(events))
        _detached.add(task)
        task.add_done_callback(_detached.discard)

    async def _pump(self, events: Recorder) -> None:
        try:
            async for ev in events:
                self._events.put_nowait(ev)
        except BaseException as e:
            self._events.put_nowait(e)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            await events.aclose()  # settles the flight: the result is stored for replays
        self._events.put_nowait(_END)

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self._events.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        """The client is gone (or done): the flight goes on without it."""
