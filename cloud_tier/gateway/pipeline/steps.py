"""The steps of the pipeline in which our workers and foreign (OpenAI-compatible) workers differ,
behind one interface: ``GatewayService.begin`` runs the same steps in the same order for both
(idempotency, the cache lookup, quotas, then admission and the worker's stream), and asks the
pool's kind of worker (``WorkerSteps``) only for what differs. ``prepare`` reads the request
(our tokenizer's plan, or a foreign request's text) and sets the flight's cache key; the job it
returns estimates the request's tokens, admits it on a worker and opens its event stream."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from cloud_tier.gateway.pipeline.flight import Flight
from cloud_tier.gateway.pipeline.results import ForeignStream, OwnStream
from cloud_tier.gateway.workers.usage import UsageBounds


@dataclass(frozen=True)
class Estimate:
    """What a request may use before it runs: the tokens charged to its quotas up front, its
    prompt's tokens, and the most a worker may say it used."""

    predicted_tokens: int
    prompt_tokens: int
    bounds: UsageBounds


class Job(Protocol):
    """One request on one kind of worker, from its cache miss to its event stream."""

    headers: dict[str, str]  # what every answer of this request carries (X-Cascade-Cache: miss, ...)
    observe: Callable[[Flight, object], object]  # what each event tells the flight (``pipeline.flight``)

    def estimate(self) -> Estimate: ...

    def estimate_ready(self) -> bool:
        """``estimate()`` costs next to nothing now (a body our workers' pool saw before is planned,
        its prompt tokenized, only on a cache miss): then the cache lookup admits a miss at once."""

    async def admit(self) -> None:
        """Room on a worker: sets the flight's ticket, or raises (an APIError: no room)."""

    def events(self) -> AsyncIterator: ...

    def answer(self, events: AsyncIterator) -> OwnStream | ForeignStream:
        """The recorded event stream as the result of its kind."""


class WorkerSteps(Protocol):
    def prepare(self, flight: Flight, endpoint: str, body: dict, req, priority: int,
                request_id: str | None, plan=None) -> Job:
        """The request read for this kind of worker; sets ``flight.cache_key`` (None: not cacheable)."""
