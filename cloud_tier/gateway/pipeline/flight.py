"""A gateway request's flight: what it holds and what it has been told (tokens, their times,
the finish and its usage, checked against the request's bounds), settled once
(``pipeline.settlement``). Our workers' events and a foreign worker's chunks are observed here."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from cascade.generation import Finish, TokenEvent, event_to_wire
from cloud_tier.gateway.foreign.answers import CHARS_PER_TOKEN, text_and_finish, usage_of
from cloud_tier.gateway.tenants.keys import ApiKey
from cloud_tier.gateway.workers.admission import Ticket
from cloud_tier.gateway.workers.usage import UNBOUNDED, UsageBounds, checked


@dataclass
class Flight:
    """One admitted request's commitments and timings, settled once in ``close``."""

    tenant: str
    key: ApiKey
    endpoint: str
    arrived: float
    predicted_tokens: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0  # token events received so far
    answer_chars: int = 0  # an OpenAI-compatible worker's answer: the characters of its text so far
    bounds: UsageBounds = UNBOUNDED  # the most a worker may say this request used (``workers.usage``)
    usage_problem: str = ""  # why the worker's usage was refused or clamped ("": it was not)
    ticket: Ticket | None = None
    cache_key: str | None = None
    idem_key: str | None = None
    idem_owner: str | None = None  # our claim's owner token while we hold it
    heartbeat: asyncio.Task | None = None  # renews that claim's lease while the flight runs
    events: list[dict] = field(default_factory=list)
    finish: Finish | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    error: Exception | None = None  # why the stream failed (the worker, not the client); None: it did not
    settled: bool = False
    ended: bool = False  # its event stream ran to its end
    openai: str | None = None  # an OpenAI-compatible worker's answer: "chunks" (a stream) or "body"
    model: str = ""  # the model asked for, when the pool serves several
    finish_reason: str | None = None  # an OpenAI-compatible worker's: the last one its chunks named
    priority_class: str = "interactive"  # cascade.protocol.PRIORITY_CLASSES
    deadline_s: float | None = None  # X-Cascade-Deadline: seconds left at arrival


def observe_event(f: Flight, ev):
    """What our workers' events tell a flight: tokens, their times, the finish (its usage checked
    against the flight's bounds: what is passed on, stored and charged). The event to pass on."""
    if isinstance(ev, TokenEvent):
        f.generated_tokens += 1
        f.last_token_at = time.perf_counter()
        if f.first_token_at is None:
            f.first_token_at = f.last_token_at
    elif isinstance(ev, Finish):
        usage, problem = checked(ev.prompt_tokens, ev.completion_tokens, f.bounds)
        f.usage_problem = problem or f.usage_problem
        prompt, completion = usage or (f.prompt_tokens, f.generated_tokens)
        if (prompt, completion) != (ev.prompt_tokens, ev.completion_tokens) or not 0 <= ev.cached_tokens <= prompt:
            ev = dataclasses.replace(ev, prompt_tokens=prompt, completion_tokens=completion,
                                     cached_tokens=min(max(0, ev.cached_tokens), prompt))
        f.finish = ev
    f.events.append(event_to_wire(ev))
    return ev


def observe_chunk(f: Flight, item):
    """What an OpenAI-compatible worker's chunks (each (chunk, its bytes)) or its one body (a dict)
    tell a flight: a chunk with text counts as a token until the worker's usage, which ends the
    flight, says how many. A usage refused or clamped (``workers.usage``) is replaced by the
    numbers charged: the chunk is then passed on as a dict, to be written again; otherwise the
    item as it came (a chunk's bytes relayed unchanged)."""
    chunk = item[0] if type(item) is tuple else item
    f.events.append(chunk)
    chars, reason = text_and_finish(chunk)
    if chars:
        f.answer_chars += chars
        f.generated_tokens += 1
        f.last_token_at = time.perf_counter()
        if f.first_token_at is None:
            f.first_token_at = f.last_token_at
    if reason is not None:
        f.finish_reason = reason
    usage = usage_of(chunk)
    if usage is None and f.openai == "body":  # a whole answer without usage: ours, estimated, in its place
        usage = estimated_usage(f)
        chunk["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}
    if usage is not None:
        checked_usage, f.usage_problem = checked(*usage, f.bounds)
        prompt, completion = checked_usage or estimated_usage(f)
        if f.usage_problem:
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}
            item = chunk
        f.finish = Finish(f.finish_reason or "stop", prompt, completion)
    return item


def estimated_usage(f: Flight) -> tuple[int, int]:
    """A foreign answer's usage when its worker gives none (or one refused): the prompt's estimate,
    and the answer's (its characters, or the chunks with text where those are more)."""
    completion = max(f.generated_tokens, f.answer_chars // CHARS_PER_TOKEN, 1) if f.answer_chars else 0
    return f.prompt_tokens, min(completion, f.bounds.completion)
