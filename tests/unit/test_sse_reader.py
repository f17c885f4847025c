"""The edge agent's reader of the cloud's SSE answer (issue 37, the class "bytes from the cloud used
unchecked"): lines split on b"\\n" only, so a raw U+2028 (or U+0085, a form feed) inside a token
reaches the app intact; a giant line is refused as soon as it passes its bound, never read whole;
each event decoded by the strict decoder. The cloud is a fake (httpx.MockTransport) that injects
the faults; the reader is the agent's own ``Upstream.escalate``."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from cascade import errors, sse
from cascade.generation import Finish, TokenEvent
from edge_agent.config import UpstreamConfig
from edge_agent.upstream import Upstream, UpstreamUnavailable

TOKENS = ["Hello", " line\u2028sep", "ara\u0085tor", " form\x0cfeed", " para\u2029graph", "\u2028"]


def chunk(text: str | None = None, finish: str | None = None, usage: dict | None = None) -> bytes:
    body = {"id": "c1", "object": "chat.completion.chunk", "model": "cloud-m",
            "choices": [] if text is None and finish is None else
            [{"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"  # raw U+2028, as many servers write


class FakeCloud:
    def __init__(self, body):
        self.body = body  # an async generator function of bytes
        self.pulled = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        async def counted():
            async for data in self.body():
                self.pulled += len(data)
                yield data
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=counted())


def upstream(cloud: FakeCloud) -> Upstream:
    up = Upstream(UpstreamConfig(url="http://cloud.test", model="cloud-m"), device="d1")
    up.client = httpx.AsyncClient(transport=httpx.MockTransport(cloud.handle), headers=up.client.headers)
    return up


async def escalate(up: Upstream) -> list:
    esc = await up.escalate("chat", {"messages": [{"role": "user", "content": "hi"}]}, "forced", retries=0)
    return [e async for e in esc.events]


def test_a_raw_line_separator_inside_a_token_reaches_the_app_intact():
    async def body():
        for t in TOKENS:
            yield chunk(t)
        yield chunk(finish="stop")
        yield chunk(usage={"prompt_tokens": 3, "completion_tokens": 6})
        yield b"data: [DONE]\n\n"

    events = asyncio.run(escalate(upstream(FakeCloud(body))))
    assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == "".join(TOKENS)
    assert events[-1] == Finish("stop", 3, 6)


def test_a_giant_line_after_the_first_chunk_ends_the_stream_with_an_error_not_reading_it_whole():
    async def body():
        yield chunk("Hi")
        yield b'data: {"choices": [{"delta": {"content": "'
        for _ in range(80):  # 5 MiB in one line
            yield b"x" * (64 << 10)
        yield b'"}}]}\n\ndata: [DONE]\n\n'

    cloud = FakeCloud(body)
    with pytest.raises(errors.APIError) as e:
        asyncio.run(escalate(upstream(cloud)))
    assert e.value.status == 502 and e.value.code == "upstream_broken"
    assert cloud.pulled <= sse.MAX_EVENT_BYTES + (128 << 10)


def test_a_giant_first_line_is_no_answer_and_the_agent_serves_it_another_way():
    async def body():
        for _ in range(80):
            yield b"data: " + b"{" * (64 << 10)

    cloud = FakeCloud(body)
    with pytest.raises(UpstreamUnavailable):
        asyncio.run(escalate(upstream(cloud)))
    assert cloud.pulled <= sse.MAX_EVENT_BYTES + (128 << 10)


@pytest.mark.parametrize("bad", [b'{"choices": [], "x": NaN}', b'{"choices": [], "x": 1e999}',
                                 b'{"choices": [{"delta": {"content": "\\ud800"}}]}'])
def test_a_chunk_the_strict_decoder_refuses_breaks_the_stream(bad):
    async def body():
        yield chunk("Hi")
        yield b"data: " + bad + b"\n\n"
        yield b"data: [DONE]\n\n"

    with pytest.raises(errors.APIError) as e:
        asyncio.run(escalate(upstream(FakeCloud(body))))
    assert e.value.status == 502


def test_a_lying_usage_is_clamped_before_the_agent_counts_it():
    async def body():
        yield chunk("Hi", finish="stop")
        yield chunk(usage={"prompt_tokens": -5, "completion_tokens": 10**15})
        yield b"data: [DONE]\n\n"

    events = asyncio.run(escalate(upstream(FakeCloud(body))))
    assert events[-1] == Finish("stop", 0, 2**31 - 1)


def test_lines_split_on_newline_only_and_carriage_returns_before_it_go():
    async def chunks():
        for piece in (b"a\xe2\x80\xa8b\r", b"\nc\x0cd\n", b"tail"):
            yield piece

    async def collect():
        return [line async for line in sse.lines(chunks(), 16)]

    assert asyncio.run(collect()) == ["a\u2028b".encode(), b"c\x0cd", b"tail"]
