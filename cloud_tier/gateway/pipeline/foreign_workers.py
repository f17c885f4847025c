"""The pipeline's steps on foreign (OpenAI-compatible) workers: the body goes to the worker as it
is; tokens are estimated from its characters until the worker's usage says (quotas are trued up
then); routing and admission read the workers' own load numbers (``foreign.routing``), and
``foreign.proxy`` relays the worker's chunks or body."""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cloud_tier.gateway.foreign import answers
from cloud_tier.gateway.foreign.proxy import Attempt, OpenAIProxy
from cloud_tier.gateway.foreign.routing import ForeignRouting, choose
from cloud_tier.gateway.pipeline.flight import Flight, observe_chunk
from cloud_tier.gateway.pipeline.results import ForeignStream
from cloud_tier.gateway.pipeline.steps import Estimate
from cloud_tier.gateway.workers.admission import Admission, Ticket
from cloud_tier.gateway.workers.placement import PrefixIndex, text_block_hashes
from cloud_tier.gateway.workers.pool import WorkerPool
from cloud_tier.gateway.workers.usage import foreign_bounds

TEXT_BLOCK_TOKENS = 16  # the KV blocks a foreign request is taken to need: its predicted tokens in 16s


@dataclass
class ForeignWorkers:
    pool: WorkerPool
    admission: Admission
    routing: ForeignRouting
    text_index: PrefixIndex  # prompt text blocks -> the workers that saw them last
    proxy: OpenAIProxy
    default_max_tokens: int
    max_model_len: int | None  # the shortest the workers state (None: none does)

    def prepare(self, flight: Flight, endpoint: str, body: dict, req, priority: int,
                request_id: str | None, plan=None) -> ForeignJob:
        if "cascade" in body:  # our own extension (a device's draft, its tier options): no foreign worker's
            body = {k: v for k, v in body.items() if k != "cascade"}
        flight.openai = "chunks" if body.get("stream") else "body"
        flight.model = str(body.get("model", ""))  # a foreign pool may serve several: priced by the one asked
        # an answer a deadline may have cut (X-Cascade-Deadline, the body's timeout) is no answer to keep
        deadline = flight.deadline_s is not None or body.get("timeout") is not None
        flight.cache_key = None if deadline else answers.cache_key(flight.tenant, endpoint, body)
        return ForeignJob(self, flight, endpoint, body, priority, request_id or uuid.uuid4().hex)


class ForeignJob:
    observe = staticmethod(observe_chunk)

    def __init__(self, steps: ForeignWorkers, flight: Flight, endpoint: str, body: dict, priority: int,
                 request_id: str):
        self.steps = steps
        self.flight = flight
        self.endpoint = endpoint
        self.body = body
        self.priority = priority
        self.request_id = request_id
        self.headers = {"X-Cascade-Cache": "miss", "X-Request-Id": request_id}
        self.text = answers.prompt_text(endpoint, body)
        self.max_tokens = answers.max_tokens_of(body)
        self.predicted = answers.estimate_tokens(self.text) + (
            steps.default_max_tokens if self.max_tokens is None else self.max_tokens)
        self.need = 0
        self.hashes: list = []
        self.roles: tuple[str, ...] = ()
        self.hit_blocks = 0

    def estimate_ready(self) -> bool:
        return True

    def estimate(self) -> Estimate:
        return Estimate(self.predicted, answers.estimate_tokens(self.text), foreign_bounds(
            self.endpoint, self.body, self.text, self.max_tokens, self.steps.max_model_len))

    async def admit(self) -> None:
        s = self.steps
        self.need = math.ceil(self.predicted / TEXT_BLOCK_TOKENS)
        self.hashes = text_block_hashes(str(self.body.get("model", "")), self.text)
        self.roles = ("decode",) if s.pool.by_role("decode", healthy=False) else ("both",)
        self.flight.ticket, self.hit_blocks = choose(s.pool.by_role(*self.roles), s.text_index, self.hashes,
                                                     self.priority, s.routing, self.need)

    def _rechoose(self, exclude: frozenset[str]):
        s = self.steps
        return choose(s.pool.by_role(*self.roles), s.text_index, self.hashes, self.priority, s.routing, self.need,
                      exclude)[0]

    def _on_ticket(self, ticket: Ticket) -> None:
        self.steps.admission.release(self.flight.ticket)
        self.flight.ticket = ticket

    def events(self) -> AsyncIterator[dict]:
        f, body = self.flight, self.body
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        attempt = Attempt(path, body, bool(body.get("stream")), self.request_id, len(self.text), len(self.hashes),
                          f.priority_class, deadline_of(f, body))
        return self.steps.proxy.run(attempt, f.ticket, self.hit_blocks, self._rechoose, self._on_ticket)

    def answer(self, events: AsyncIterator) -> ForeignStream:
        return ForeignStream(events, self.headers)


def deadline_of(f: Flight, body: dict) -> float | None:
    """When a request sent to an OpenAI-compatible worker must be over (``time.perf_counter``): the
    earlier of its X-Cascade-Deadline and its body's ``timeout`` (seconds), None without either."""
    limits = [t for t in (f.deadline_s, body.get("timeout")) if isinstance(t, (int, float))
              and not isinstance(t, bool) and 0 <= t < 1e9]
    return f.arrived + min(limits) if limits else None
