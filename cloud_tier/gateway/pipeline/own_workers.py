"""The pipeline's steps on our own workers: the prompt is planned by the model's tokenizer (the
result cache keys on its token ids, remembered per body so that a repeated body skips the
tokenizer), KV blocks are admitted on a decode worker, and ``WorkerClient`` streams its events."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import AsyncIterator

from cascade.generation import Finish, TokenEvent
from cloud_tier.gateway.pipeline.flight import Flight, observe_event
from cloud_tier.gateway.pipeline.result_cache import ResultCache, cache_key
from cloud_tier.gateway.pipeline.results import OwnStream
from cloud_tier.gateway.pipeline.steps import Estimate
from cloud_tier.gateway.pipeline.worker_client import WorkerClient
from cloud_tier.gateway.workers.pool import WorkerPool
from cloud_tier.gateway.workers.usage import UsageBounds
from cloud_tier.request_builder import RequestBuilder, RequestPlan


class OwnWorkers:
    def __init__(self, builder: RequestBuilder, model_id: str, pool: WorkerPool, workers: WorkerClient,
                 cache_keys: ResultCache):
        self.builder = builder
        self.model_id = model_id
        self.pool = pool
        self.workers = workers
        # (tenant, endpoint, a body's digest) -> its result cache key: the prompt's token ids need the
        # tokenizer, by far the costliest step of a cache hit (a body's plan never changes)
        self.cache_keys = cache_keys

    def prepare(self, flight: Flight, endpoint: str, body: dict, req, priority: int,
                request_id: str | None, plan: RequestPlan | None = None) -> OwnJob:
        """``plan``: the request's plan when the caller made it already (off the event loop)."""
        # a body this tenant sent before has the same plan, so the same cache key: a hit is
        # looked up without rendering and tokenizing the prompt again (the digest of the body's
        # repr: the same for the same JSON object, at a third of request_hash's cost)
        seen = (flight.tenant, endpoint, hashlib.sha256(repr(body).encode()).digest())
        flight.cache_key = self.cache_keys.get(seen)
        job = OwnJob(self, flight, endpoint, req, priority)
        job.plan = plan
        if flight.cache_key is None:
            job.plan = plan or self.plan(endpoint, req, priority)
            # a sampled answer verified against a draft is drawn another way than the same seed's without
            # one (greedy ones are equal): it is not the seed's answer to keep or to take
            sampled_draft = job.plan.draft is not None and job.plan.params.temperature != 0
            flight.cache_key = None if sampled_draft else cache_key(flight.tenant, self.model_id, endpoint, job.plan)
            if flight.cache_key:
                self.cache_keys.put(seen, flight.cache_key, 0, owner=flight.tenant)
        return job

    def plan(self, endpoint: str, req, priority: int) -> RequestPlan:
        plan = self.builder.chat(req) if endpoint == "chat" else self.builder.completion(req)
        return dataclasses.replace(plan, priority=priority)


class OwnJob:
    observe = staticmethod(observe_event)

    def __init__(self, steps: OwnWorkers, flight: Flight, endpoint: str, req, priority: int):
        self.steps = steps
        self.headers = {"X-Cascade-Cache": "miss"}
        self.flight = flight
        self.endpoint = endpoint
        self.req = req
        self.priority = priority
        self.plan: RequestPlan | None = None  # None until planned (a body seen before is planned on a cache miss only)
        self.need = 0  # KV blocks

    def estimate_ready(self) -> bool:
        return self.plan is not None

    def estimate(self) -> Estimate:
        if self.plan is None:  # seen before, but its answer is no longer cached
            self.plan = self.steps.plan(self.endpoint, self.req, self.priority)
        prompt = len(self.plan.prompt_token_ids)
        return Estimate(self.plan.max_total_tokens, prompt, UsageBounds(prompt, self.plan.params.max_tokens))

    async def admit(self) -> None:
        self.need = math.ceil(self.plan.max_total_tokens / self.steps.pool.block_size)
        self.flight.ticket = await self.steps.workers.admit(self.flight, self.plan, self.need)

    def events(self) -> AsyncIterator[TokenEvent | Finish]:
        return self.steps.workers.generate(self.flight, self.plan, self.need)

    def answer(self, events: AsyncIterator) -> OwnStream:
        return OwnStream(events, self.headers)
