"""The end of a drain: at SIGTERM, answers still in flight after ``[server] drain_timeout_s`` end
in-band (a stream with an SSE error event and ``data: [DONE]``, a plain answer with a 503) instead
of being cut, and their generations stop before the model is unloaded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from cascade import errors


class Drain:
    """Set once per process, at the drain's deadline (``end``); every answer passes through
    ``guard`` so that it ends then, whichever tier answers it."""

    def __init__(self) -> None:
        self._ended = asyncio.Event()

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    def end(self) -> None:
        self._ended.set()

    @staticmethod
    def error() -> errors.APIError:
        return errors.APIError(503, "The edge agent is shutting down and its drain time ran out before this "
                               "answer was complete; retry it.", "server_error", code="shutting_down",
                               headers={"Retry-After": "1"})

    async def guard(self, events: AsyncIterator) -> AsyncIterator:
        """``events`` until they end or the drain does; then ``events`` is closed (a local
        generation is cancelled) and ``error()`` raised in its place."""
        ended = asyncio.ensure_future(self._ended.wait())
        step: asyncio.Future | None = None
        try:
            while True:
                step = asyncio.ensure_future(anext(events))
                await asyncio.wait((step, ended), return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    raise self.error()
                try:
                    event = step.result()
                except StopAsyncIteration:
                    return
                yield event
        finally:
            ended.cancel()
            if step is not None and not step.done():  # the drain ended, or our caller was cancelled
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
            await events.aclose()
