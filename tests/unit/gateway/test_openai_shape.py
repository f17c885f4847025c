"""The shape a worker's answer must have (issue 37 item 2), which refusals count on a worker's
breaker (item 1), and the stream <-> body conversions that must never raise on a stored answer."""

from __future__ import annotations

import json

import pytest

from cloud_tier.gateway.foreign.answers import chunks_to_response, response_to_chunks
from cloud_tier.gateway.foreign.shape import body_problem, chunk_problem, is_openai_error, worker_is_unwell

DELTA = {"index": 0, "delta": {"role": "assistant", "content": "Red"}, "finish_reason": None}
MESSAGE = {"index": 0, "message": {"role": "assistant", "content": "Red"}, "finish_reason": "stop"}


@pytest.mark.parametrize("chunk,chat,problem", [
    ({"id": "c", "created": 1, "model": "m", "choices": [DELTA]}, True, ""),
    ({"choices": [], "usage": {"prompt_tokens": 1}}, True, ""),
    ({"choices": [{"index": 0, "finish_reason": "stop"}]}, True, ""),  # only a finish_reason
    ({"choices": [{"index": 0, "delta": {"content": None, "tool_calls": [{"index": 0}]}}]}, True, ""),
    ({"choices": [{"index": 0, "text": "Red", "logprobs": {"tokens": ["Red"]}}]}, False, ""),
    ({"choices": [{"index": 0, "delta": "stringdelta"}]}, True, "a delta that is not an object"),
    ({"choices": ["notadict"]}, True, "a choice that is not an object"),
    ({"choices": [{"index": 0, "delta": {"content": 5}}]}, True, "a delta's content that is not a string"),
    ({"choices": [{"index": 0, "delta": {"role": ["x"]}}]}, True, "a delta's role that is not a string"),
    ({"choices": [{"index": True, "delta": {}}]}, True, "a choice whose index is not a small integer"),
    ({"choices": [{"index": 10**30, "delta": {}}]}, True, "a choice whose index is not a small integer"),
    ({"choices": [{"index": 0, "delta": {}, "finish_reason": 3}]}, True, "a finish_reason that is not a string"),
    ({"choices": [{"index": 0, "delta": {}, "logprobs": "x"}]}, True, "logprobs that are not an object"),
    ({"choices": [{"index": 0, "text": {"x": 1}}]}, False, "a text that is not a string"),
    ({"choices": 5}, True, "choices that are not a list"),
    ({"choices": [], "usage": 7}, True, "a usage that is not an object"),
    ({"choices": [], "model": 3}, True, "the model is of the wrong type"),
])
def test_a_chunks_shape(chunk, chat, problem):
    assert chunk_problem(chunk, chat) == problem


@pytest.mark.parametrize("body,chat,problem", [
    ({"id": "c", "choices": [MESSAGE], "usage": {"prompt_tokens": 1}}, True, ""),
    ({"choices": [{"index": 0, "text": "Red", "finish_reason": "length"}]}, False, ""),
    ({"choices": [{"index": 0, "message": "stringmessage"}]}, True, "a message that is not an object"),
    ({"choices": [{"index": 0}]}, True, "a message that is not an object"),
    ({"choices": ["notadict"]}, True, "a choice that is not an object"),
    ({"choices": [{"index": 0, "message": {"content": 5}}]}, True, "a message's content that is not a string"),
    ({"id": "c"}, True, "choices that are not a list"),
    ([MESSAGE], True, "not an object"),
])
def test_a_bodys_shape(body, chat, problem):
    assert body_problem(body, chat) == problem


@pytest.mark.parametrize("status,content,unwell", [
    (500, {"error": {"message": "the prompt broke it", "type": "server_error"}}, False),
    (501, {"error": {"message": "not here"}}, False),
    (500, b"Internal Server Error", True),
    (500, {"error": "boom"}, True),
    (500, {"error": {"message": ""}}, True),
    (502, {"error": {"message": "upstream"}}, True),
    (503, {"error": {"message": "overloaded"}}, True),
    (504, b"", True),
    (429, {"error": {"message": "slow down"}}, False),
    (408, b"", False),
])
def test_which_refusals_say_the_worker_is_unwell(status, content, unwell):
    raw = content if isinstance(content, bytes) else json.dumps(content).encode()
    assert worker_is_unwell(status, raw) is unwell
    assert is_openai_error(raw) is (isinstance(content, dict) and isinstance(content.get("error"), dict)
                                    and bool(content["error"].get("message")))


BAD_CHUNKS = [{"choices": [{"delta": "stringdelta"}]}, {"choices": ["notadict"]}, "notadict",
              {"choices": [{"index": "0", "delta": {"content": 5, "role": 3}, "finish_reason": []}], "usage": 5},
              {"choices": 5}]
BAD_BODIES = [{"choices": [{"message": "stringmessage"}]}, {"choices": ["notadict"]}, {"choices": 5}, "notadict",
              {"choices": [{"index": None, "message": {"content": 5}, "text": 7, "logprobs": "x"}], "usage": 1}]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_the_conversions_never_raise_on_a_malformed_answer(endpoint):
    for bad in BAD_CHUNKS:
        body = chunks_to_response([bad], endpoint)
        assert isinstance(body["choices"], list) and "usage" not in body
    for bad in BAD_BODIES:
        chunks = response_to_chunks(bad, endpoint)
        assert all(isinstance(c["choices"], list) for c in chunks)
        assert chunks_to_response(chunks, endpoint)["choices"] is not None


def test_a_good_answer_survives_both_conversions():
    body = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [MESSAGE],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    again = chunks_to_response(response_to_chunks(body, "chat"), "chat")
    assert again["choices"][0]["message"] == MESSAGE["message"] and again["usage"] == body["usage"]


@pytest.mark.parametrize("status,content,counted", [
    (500, {"error": {"message": "this prompt broke it"}}, 0),
    (400, {"error": {"message": "bad request"}}, 0),
    (503, {"error": {"message": "overloaded"}}, 1),
    (500, "Internal Server Error", 1),
])
def test_a_prefill_refusal_counts_on_the_prefill_workers_breaker_only_when_it_is_unwell(status, content, counted):
    """Item 1 for a vLLM P/D pair: one tenant's poison prompt must not open the prefill worker's
    breaker either (the request decodes alone, as after any failed prefill)."""
    import asyncio

    import httpx
    from aiohttp import web

    from cloud_tier.gateway.foreign.proxy import Attempt, OpenAIProxy, ProxyConfig
    from cloud_tier.gateway.workers.http_client import WorkerHTTP
    from cloud_tier.gateway.workers.pool import WorkerPool

    sent = []

    async def answer(request: web.Request) -> web.Response:  # the prefill worker: a real HTTP server
        sent.append(request.path)
        if isinstance(content, dict):
            return web.json_response(content, status=status)
        return web.Response(text=content, status=status)

    async def run() -> int:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        http = WorkerHTTP()
        try:
            async with httpx.AsyncClient() as client:
                pool = WorkerPool([url, "http://d"], client, kind="openai",
                                  roles={url: "prefill", "http://d": "decode"})
                pool.decide_mode()
                for w in pool.workers.values():
                    w.healthy = True
                proxy = OpenAIProxy(pool, http, ProxyConfig(kv_connector="nixl", pd_min_prompt_chars=1))
                a = Attempt("/v1/chat/completions", {"messages": []}, False, "r1", prompt_chars=10, hashes_total=1)
                body = await proxy._with_prefill(a, {"messages": []}, pool.workers["http://d"], 0)
                assert "kv_transfer_params" not in body and sent == ["/v1/chat/completions"]  # decoded alone
                return pool.workers[url].breaker.failures
        finally:
            await http.close()
            await runner.cleanup()
    assert asyncio.run(run()) == counted
