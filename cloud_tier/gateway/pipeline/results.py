"""What the pipeline (``GatewayService.begin``) hands back: one of four kinds of result, each
with the response headers it adds. A stored answer (a result cache hit, an Idempotency-Key's
replay) is our workers' events or a foreign worker's chunks or body; a live answer is our
workers' event stream or a foreign worker's chunk stream. Each kind answers a Batch API line
whole (``whole``); the HTTP shell renders each kind with one function of its own
(``http.render``). Nothing downstream looks inside a result to learn its kind."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cascade import errors
from cascade.generation import Finish, TokenEvent, event_from_wire
from cloud_tier.gateway.foreign.answers import chunks_to_response, response_to_chunks


@dataclass(frozen=True)
class CachedAnswer:
    """Our workers' answer, stored: its wire events (``record["events"]``) and, once rendered, the
    JSON template a fresh id and time go into (``record["json_template"]``, kept on the record)."""

    record: dict
    headers: dict[str, str]

    def events(self) -> AsyncIterator[TokenEvent | Finish]:
        return replay(self.record)

    def json_body(self, fmt) -> bytes:
        return render_stored(self.record, fmt)

    async def whole(self, endpoint: str, fmt) -> dict:
        return json.loads(self.json_body(fmt))


@dataclass(frozen=True)
class CachedForeignAnswer:
    """A foreign worker's answer, stored in the shape it came in (``record["openai"]``: "chunks"
    of a stream or one "body"), given in the shape the request wants."""

    record: dict
    headers: dict[str, str]

    def body(self, endpoint: str) -> dict:
        events = self.record["events"]
        return events[0] if self.record["openai"] == "body" else chunks_to_response(events, endpoint)

    def chunks(self, endpoint: str) -> AsyncIterator[dict]:
        events = self.record["events"]
        return replay_chunks(events if self.record["openai"] == "chunks" else response_to_chunks(events[0], endpoint))

    async def whole(self, endpoint: str, fmt) -> dict:
        return self.body(endpoint)


@dataclass(frozen=True)
class OwnStream:
    """Our workers' answer as it comes: TokenEvents, then a Finish (recorded and settled by
    ``pipeline.recorder``)."""

    events: AsyncIterator[TokenEvent | Finish]
    headers: dict[str, str]

    async def whole(self, endpoint: str, fmt) -> dict:
        tokens = []
        try:
            async for ev in self.events:
                tokens.append(ev)
        finally:
            await self.events.aclose()
        return fmt.response(tokens[:-1], tokens[-1]).model_dump(exclude_none=True)


@dataclass(frozen=True)
class ForeignStream:
    """A foreign worker's answer as it comes: its chunks, or the one JSON body it answered."""

    events: AsyncIterator[dict]
    headers: dict[str, str]

    async def whole(self, endpoint: str, fmt) -> dict:
        return await first_of(self.events)


Result = CachedAnswer | CachedForeignAnswer | OwnStream | ForeignStream


def stored(record: dict, headers: dict[str, str]) -> CachedAnswer | CachedForeignAnswer:
    """A stored answer as its kind: a foreign worker's is stored with the shape it came in."""
    return CachedForeignAnswer(record, headers) if "openai" in record else CachedAnswer(record, headers)


async def replay(stored: dict) -> AsyncIterator[TokenEvent | Finish]:
    for data in stored["events"]:
        yield event_from_wire(data)


def render_stored(stored: dict, fmt) -> bytes:
    """A stored result as a non-streamed body: rendered once, as a template that only a fresh id
    and time go into (the same bytes as dumping the response with them, at under half the cost)."""
    template = stored.get("json_template")
    if template is None:
        events = [event_from_wire(e) for e in stored["events"]]
        body = fmt.response(events[:-1], events[-1]).model_dump(exclude_none=True)
        template = stored["json_template"] = _template({**body, "id": None, "created": None})
    return (template % {"id": json.dumps(fmt.id), "created": json.dumps(fmt.created)}).encode()


def _template(body: dict) -> str:
    """``body`` as compact JSON with %(id)s and %(created)s in place of those two values."""
    items = [f"{json.dumps(k)}:%({k})s" if k in ("id", "created") else
             f"{json.dumps(k)}:{json.dumps(v, separators=(',', ':'))}".replace("%", "%%") for k, v in body.items()]
    return "{" + ",".join(items) + "}"


async def replay_chunks(chunks: list[dict]) -> AsyncIterator[dict]:
    for c in chunks:
        yield c


async def first_of(events) -> dict:
    """The one item of a stream that has one (a worker's JSON body), read to the stream's end (so
    that the flight counts as answered), the stream closed after."""
    items = []
    try:
        async for item in events:
            items.append(item)
    finally:
        await events.aclose()
    if not items:
        raise errors.APIError(502, "The cloud worker gave no answer.", "server_error", code="worker_failed")
    return items[0]
