"""Issue 37 item 2: a worker's answer that is not OpenAI-shaped (a delta that is a string, a choice
that is not an object, a message whose content is a number) is a 502 (or, once streaming, an
error event and [DONE]) and never reaches the result cache, so the same greedy request in the
other shape (streamed <-> not) goes to the worker again instead of failing from the cache. The
real gateway in process, a model-free worker that answers as the test says."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.responses import JSONResponse, StreamingResponse

from tests.integration.batch_fakes import MODEL, FakeOpenAIWorker, InProcessGateway
from tests.integration.worker_checks import well_formed

BASE = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
GOOD = {**BASE, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Red"}, "finish_reason": None}]}
USAGE = {**BASE, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
BAD_CHOICES = {"string_delta": [{"index": 0, "delta": "stringdelta", "finish_reason": "stop"}],
               "choice_not_a_dict": ["notadict"],
               "content_a_number": [{"index": 0, "delta": {"content": 5}, "finish_reason": "stop"}]}
BAD_BODIES = {"string_message": [{"index": 0, "message": "stringmessage", "finish_reason": "stop"}],
              "choice_not_a_dict": ["notadict"],
              "content_a_number": [{"index": 0, "message": {"role": "assistant", "content": 5},
                                    "finish_reason": "stop"}]}


def sse(*chunks: dict) -> StreamingResponse:
    async def play():
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(play(), media_type="text/event-stream")


def answering(streamed, whole):
    """A hook: ``streamed`` to a streamed request, ``whole`` to one that is not (None: the honest answer)."""
    async def hook(body):
        if body.get("stream"):
            return streamed
        return None if whole is None else JSONResponse(whole)
    return hook


@pytest.fixture(scope="module")
def worker():
    w = FakeOpenAIWorker().start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, worker):
    g = InProcessGateway(tmp_path_factory.mktemp("shapes"), worker.url, retries=0, breaker_threshold=1000).start()
    g.k = g.key("shapes")
    yield g
    g.stop()


def ask(g, text: str, stream: bool) -> httpx.Response:
    return httpx.post(f"{g.url}/v1/chat/completions", headers={"authorization": f"Bearer {g.k}"}, timeout=20,
                      json={"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4,
                            "temperature": 0, "stream": stream})


@pytest.mark.parametrize("case", list(BAD_CHOICES))
@pytest.mark.parametrize("where", ["first", "mid"])
def test_a_malformed_stream_is_refused_and_never_cached(gateway, worker, case, where):
    bad = {**BASE, "choices": BAD_CHOICES[case]}
    worker.hook = answering(sse(bad, USAGE) if where == "first" else sse(GOOD, bad, USAGE), None)
    text = f"stream {case} {where}"
    r = ask(gateway, text, stream=True)
    status, kind, err = well_formed(r, stream=True)
    assert kind == "error" and status == (502 if where == "first" else 200), (status, err)
    worker.hook = answering(sse(GOOD, USAGE), None)
    again = ask(gateway, text, stream=False)  # not served from a poisoned cache: the worker answers
    assert again.status_code == 200 and again.headers["x-cascade-cache"] == "miss", again.text[:300]
    assert again.json()["choices"][0]["message"]["content"] == "ok"


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_a_malformed_body_is_refused_and_never_cached(gateway, worker, case):
    worker.hook = answering(None, {**BASE, "object": "chat.completion", "choices": BAD_BODIES[case],
                                   "usage": USAGE["usage"]})
    text = f"body {case}"
    r = ask(gateway, text, stream=False)
    status, kind, err = well_formed(r, stream=False)
    assert (status, kind) == (502, "error") and err["code"] == "worker_bad_response", (status, err)
    worker.hook = answering(sse(GOOD, USAGE), None)
    again = ask(gateway, text, stream=True)
    assert again.headers["x-cascade-cache"] == "miss" and well_formed(again, stream=True)[1:] == ("ok", "Red")
