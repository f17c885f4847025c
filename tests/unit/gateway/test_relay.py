"""The relay of a foreign worker's stream (issue 42): the reader gives the same chunks and bytes
however the stream is split into reads, bounded per line; the relay writes each chunk's bytes as
they came (the client parses the worker's own chunks), drops only what the gateway asked for on
the client's behalf, joins the chunks that carry nothing (role, usage) to the next write, and
always ends with [DONE]."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cascade import errors
from cloud_tier.gateway.http.sse import Last, relay_sse
from cloud_tier.gateway.workers.stream import ChunkReader


def chunk(i: int, text: str = "", finish: str | None = None, role: bool = False) -> dict:
    delta = {"role": "assistant", "content": ""} if role else {"content": text}
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


USAGE = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
         "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
STREAM = [chunk(0, role=True), chunk(1, "Hé\u2028llo"), chunk(2, " wörld", "stop"), USAGE]


def sse_bytes(chunks: list[dict], crlf: bool = False) -> bytes:
    end = b"\r\n" if crlf else b"\n"
    out = b": keep-alive" + end + end
    for c in chunks:
        out += b"data: " + json.dumps(c, ensure_ascii=False).encode() + end + end
    return out + b"data: [DONE]" + end + end


def read_all(data: bytes, cuts: list[int], limit: int = 1 << 16) -> list[tuple[dict, bytes]]:
    pieces, at = [], 0
    for cut in sorted(set(cuts)):
        pieces.append(data[at:cut])
        at = cut
    pieces.append(data[at:])
    parts = iter([p for p in pieces if p] + [b""])

    async def read() -> bytes:
        return next(parts, b"")

    async def run():
        reader, out = ChunkReader(read, limit), []
        while (item := await reader.next()) is not None:
            out.append(item)
        return out

    return asyncio.run(run())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(sse_bytes(STREAM, crlf=True))), max_size=12), st.booleans())
def test_any_split_of_the_stream_reads_the_same_chunks_and_bytes(cuts, crlf):
    data = sse_bytes(STREAM, crlf)
    got = read_all(data, cuts)
    assert [c for c, _ in got] == STREAM
    assert [json.loads(raw) for _, raw in got] == STREAM
    assert all(b"\n" not in raw and b"\r" not in raw for _, raw in got)


def test_a_line_over_the_bound_is_a_502_and_a_stream_without_done_too():
    data = b"data: " + json.dumps(chunk(0, "x" * 500)).encode() + b"\n\n"
    with pytest.raises(errors.APIError) as e:
        read_all(data + b"data: [DONE]\n\n", [7, 30], limit=200)
    assert e.value.status == 502 and e.value.code == "worker_event_too_large"
    with pytest.raises(errors.APIError) as e:
        read_all(data, [], limit=1 << 16)
    assert e.value.status == 502 and "no [DONE]" in e.value.message


def relay(items, include_usage: bool) -> list[bytes]:
    async def source():
        for item in items:
            yield item

    async def run():
        return [part async for part in relay_sse(source(), include_usage)]

    return asyncio.run(run())


@pytest.mark.parametrize("include_usage", [True, False])
def test_the_relay_writes_the_workers_bytes_joins_what_carries_nothing_and_ends_with_done(include_usage):
    items = [(c, json.dumps(c, ensure_ascii=False, separators=(", ", ": ")).encode()) for c in STREAM]
    parts = relay(items, include_usage)
    assert len(parts) == 3  # the role chunk with the first text, the finish, then usage + [DONE] as the end
    assert type(parts[-1]) is Last and parts[-1].endswith(b"data: [DONE]\n\n")
    body = b"".join(parts)
    events = [e[len(b"data: "):] for e in body.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    expected = STREAM if include_usage else STREAM[:-1]
    assert events[:-1] == [raw for c, raw in items if c in expected]  # the worker's own bytes, spacing and all


def test_a_chunk_the_gateway_changed_or_with_usage_inside_is_written_again_without_it():
    with_usage = {**chunk(1, "hi", "stop"), "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    parts = relay([(with_usage, json.dumps(with_usage).encode()), {**USAGE, "usage": {"prompt_tokens": 2}}], False)
    events = [json.loads(e[6:]) for e in b"".join(parts).split(b"\n\n") if e and e != b"data: [DONE]"]
    assert events == [chunk(1, "hi", "stop")]


def test_a_failure_after_the_first_byte_goes_in_band_and_the_stream_still_ends():
    async def source():
        yield (chunk(1, "a"), json.dumps(chunk(1, "a")).encode())
        raise errors.APIError(502, "boom", "server_error", code="worker_bad_stream")

    async def run():
        return [part async for part in relay_sse(source(), True)]

    body = b"".join(asyncio.run(run()))
    events = [e for e in body.split(b"\n\n") if e]
    assert json.loads(events[1][6:])["error"]["code"] == "worker_bad_stream" and events[-1] == b"data: [DONE]"
