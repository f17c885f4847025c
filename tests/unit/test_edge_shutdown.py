"""The edge agent's stop (issue 37 item 12): a generation still running when the service closes is
stopped and its thread joined before its backend is unloaded, and the drain's end turns an answer
in flight into an in-band 503."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cascade import errors
from edge_agent.backends.base import Backend, Finish, GenerationOptions, ModelDescription, TokenEvent
from edge_agent.config import EdgeConfig
from edge_agent.server.drain import Drain
from edge_agent.server.metrics import EdgeMetrics
from edge_agent.server.service import EdgeService, LocalJob


class SlowBackend(Backend):
    """A token every 20 ms until cancelled; records any token made after it was unloaded."""

    def __init__(self):
        self.description = ModelDescription("slow", "-", "test", 512, 100, True, "none")
        self.unloaded = threading.Event()
        self.used_after_unload = False
        self.generating = threading.Event()

    def load(self): ...

    def unload(self):
        self.unloaded.set()

    def tokenize(self, text, add_special=True):
        return [1]

    def detokenize(self, token_ids):
        return ""

    def apply_chat_template(self, messages):
        return ""

    def generate(self, prompt, options, cancel=None):
        self.generating.set()
        n = 0
        while not (cancel is not None and cancel.is_set()):
            time.sleep(0.02)
            self.used_after_unload |= self.unloaded.is_set()
            n += 1
            yield TokenEvent(token_id=1, text="a", piece=b"a", logprob=-0.1, entropy=0.1)
        self.used_after_unload |= self.unloaded.is_set()
        yield Finish(finish_reason="cancelled", prompt_tokens=1, completion_tokens=n, cached_tokens=0)


def job() -> LocalJob:
    return LocalJob("completion", [1], GenerationOptions(max_tokens=1000, temperature=0))


def test_close_stops_and_joins_a_running_generation_before_unloading():
    async def main():
        backend = SlowBackend()
        svc = EdgeService(EdgeConfig(), [backend], {"slow"}, EdgeMetrics())
        events = svc.run(job(), svc.admit())
        await anext(events)  # generating, and nobody closes the stream: the server is going away
        svc.close()
        time.sleep(0.1)  # what a thread left running would do next
        assert backend.unloaded.is_set() and not backend.used_after_unload

    asyncio.run(main())


def test_the_drains_end_raises_a_503_in_place_of_the_next_event_and_stops_the_generation():
    async def main():
        backend = SlowBackend()
        svc = EdgeService(EdgeConfig(), [backend], {"slow"}, EdgeMetrics())
        drain = Drain()
        j = job()
        events = drain.guard(svc.run(j, svc.admit()))
        assert isinstance(await anext(events), TokenEvent)
        drain.end()
        with pytest.raises(errors.APIError) as refused:
            while True:
                await anext(events)
        assert refused.value.status == 503 and refused.value.code == "shutting_down"
        assert j.cancel.is_set()
        await asyncio.sleep(0.2)
        assert svc.pool.busy == 0  # the slot came back once the thread stopped

    asyncio.run(main())
