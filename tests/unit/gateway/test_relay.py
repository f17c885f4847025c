"""The relay of a foreign worker's stream (issue 42): the reader gives the same chunks and bytes
however the stream is split into reads, bounded per line; the relay writes each chunk's bytes as
they came (the client parses the worker's own chunks), drops only what the gateway asked for on
the client's behalf, joins the chunks that carry nothing (role, usage) to the next write, and
always ends with [DONE]."""

from __future__ import annotations

import asyncio
import json
import time

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
    # the worker's own bytes, spacing and all; the usage chunk written again (what it says is what was charged)
    assert events[:3] == [raw for _, raw in items[:3]]
    assert [json.loads(e) for e in events[3:-1]] == ([USAGE] if include_usage else [])


def test_a_bare_cr_in_a_chunk_never_reaches_the_client():
    raw = b'{"id":"c1",\r"choices":[{"index":0,"delta":{"content":"a"},\r"finish_reason":null}]}'
    body = b"".join(relay([(json.loads(raw), raw)], True))
    assert b"\r" not in body and json.loads(body.split(b"\n\n")[0][6:]) == json.loads(raw)


def test_a_usage_given_twice_goes_out_once_as_charged():
    raw = b'{"choices":[],"usage":{"prompt_tokens":1000000000000},"usage":{"prompt_tokens":3,"completion_tokens":2}}'
    body = b"".join(relay([(json.loads(raw), raw)], True))
    assert body.count(b'"usage"') == 1 and json.loads(body.split(b"\n\n")[0][6:])["usage"]["prompt_tokens"] == 3


def test_chunks_that_carry_nothing_are_held_one_at_a_time():
    role = chunk(0, role=True)
    parts = relay([(role, json.dumps(role).encode())] * 2000 + [(chunk(1, "x"), json.dumps(chunk(1, "x")).encode())],
                  True)
    assert len(parts) == 2001 and max(len(p) for p in parts) < 1000  # never a growing buffer


@pytest.mark.parametrize("delta", [{"reasoning": "thinking"}, {"reasoning_content": "thinking"},
                                   {"role": "assistant", "content": "", "reasoning": "hm"}, {"tool_calls": []}])
def test_a_chunk_with_anything_but_a_role_goes_out_at_once(delta):
    c = {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    parts = relay([(c, json.dumps(c).encode()), (chunk(1, "x"), json.dumps(chunk(1, "x")).encode())], True)
    assert json.loads(parts[0][6:].split(b"\n\n")[0]) == c and len(parts) == 3


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


@pytest.mark.parametrize("value", ["²", "١", "٣٠", "1²", "-1", "0", "99999"])
def test_a_workers_retry_after_or_length_in_other_digits_is_no_500(value):
    from cloud_tier.gateway.workers.stream import error_of, read_all

    for status in (429, 503):
        err = error_of(b'{"error": {"message": "busy"}}', status, {"retry-after": value})
        assert err.status == status and err.headers["Retry-After"] == "1"

    async def empty() -> bytes:
        return b""

    assert asyncio.run(read_all({"content-length": value}, empty, 1 << 20)) == b""


FIRST = b"data: " + json.dumps(chunk(1, "a")).encode() + b"\n\n"


@pytest.mark.parametrize("after", [[b": ping\n\n"] * 1000, [b"data: {"] + [b" "] * 1000], ids=["pings", "drip"])
def test_what_is_no_chunk_holds_a_stream_only_until_its_idle_bound(after):
    """Pings alone, or one data line dripped a byte at a time, after a first chunk."""
    sent = iter([FIRST, *after])

    async def read() -> bytes:
        await asyncio.sleep(0.01)
        return next(sent, b"")

    async def run():
        reader = ChunkReader(read, 1 << 16, idle_s=0.3)
        assert (await reader.next())[0] == chunk(1, "a")
        await reader.next()

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        asyncio.run(run())
    assert time.monotonic() - started < 3.0  # not the 10 s the pings would last


def test_a_long_line_dripped_in_small_reads_is_read_in_linear_time():
    line = b"data: " + json.dumps(chunk(1, "x" * (1 << 20))).encode() + b"\n\ndata: [DONE]\n\n"
    t0 = time.process_time()
    got = read_all(line, list(range(100, len(line), 100)), limit=2 << 20)
    assert got[0][0]["choices"][0]["delta"]["content"] == "x" * (1 << 20)
    assert time.process_time() - t0 < 5.0  # ~10,000 reads: quadratic copying took minutes


def test_a_stream_past_what_is_kept_is_relayed_but_not_stored():
    from cloud_tier.gateway.pipeline.flight import KEEP_BYTES, Flight, observe_chunk
    from cloud_tier.gateway.tenants.keys import ApiKey

    key = ApiKey(key_id="k0000001", tenant="t", device=None, scopes=frozenset({"infer"}), rps=0, tpm=0, created_at=0)
    f = Flight("t", key, "chat", 0.0)
    f.openai = "chunks"
    big = chunk(1, "y" * (1 << 20))
    raw = json.dumps(big).encode()
    for _ in range(KEEP_BYTES // len(raw) + 2):
        assert observe_chunk(f, (big, raw)) == (big, raw)
    assert not f.kept and f.events == [] and f.answer_chars > KEEP_BYTES


def test_bytes_a_worker_writes_after_its_answer_never_reach_the_next_request():
    """A kept-alive connection to a worker that wrote more after its answer ended is not reused."""
    from cloud_tier.gateway.workers.http_client import WorkerHTTP, read_some

    def answer(text: str) -> bytes:
        body = f"data: {text}\n\ndata: [DONE]\n\n".encode()
        return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")

    async def run() -> list[bytes]:
        served = 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal served
            while await reader.readuntil(b"\r\n\r\n"):
                served += 1
                writer.write(answer(f"honest-{served}"))
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.write(answer("INJECTED"))  # after the answer ended, on the idle connection
                await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/x"
        http, got = WorkerHTTP(), []
        try:
            for _ in range(3):
                resp = await http.send("GET", url, None, {})
                body = b""
                while data := await read_some(resp):
                    body += data
                resp.release()
                got.append(body)
                await asyncio.sleep(0.2)  # the injected answer has arrived on the idle connection
        finally:
            await http.close()
            server.close()
        return got

    got = asyncio.run(run())
    assert all(b"INJECTED" not in body for body in got), got
    assert [b"honest" in body for body in got] == [True, True, True]
