"""An escalation's draft on the wire (issue 40): ``cascade.draft`` in the body is decoded strictly
(hostile values are a 400, never reach the engine), used only by a server whose tokenizer identity
is the draft's, carried to the worker in the request record, and sent by the edge agent only to a
cloud that names the same tokenizer in its model list."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cascade.generation import Finish, TokenEvent
from cascade.protocol import ChatCompletionRequest
from cascade.web.app import install_error_handlers
from cascade.web.requests import parse_body, read_json
from cloud_tier.disagg.messages import RequestRecord, decode, encode
from cloud_tier.draft import Draft, DraftError, draft_fields, draft_of
from edge_agent.config import UpstreamConfig
from edge_agent.drafts import draft_of as edge_draft_of
from edge_agent.upstream import Upstream

IDENTITY = "qwen2-" + "ab" * 16


def body(draft) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "cascade": {"draft": draft}}


GOOD = {"token_ids": [1, 2, 3], "probs": [1.0, 0.5, 0.25], "tokenizer": IDENTITY}


@pytest.mark.parametrize("bad", [
    {**GOOD, "probs": [1.0, 0.5]},  # lengths differ
    {**GOOD, "probs": [1.0, 1.5, 0.2]},  # not a probability
    {**GOOD, "probs": [1.0, float("nan"), 0.2]},
    {**GOOD, "probs": [1.0, float("inf"), 0.2]},
    {**GOOD, "token_ids": [1, -2, 3]},
    {**GOOD, "token_ids": [1, 2**40, 3]},
    {**GOOD, "token_ids": [1, "2", 3]},
    {**GOOD, "token_ids": [1, 2.5, 3]},
    {**GOOD, "token_ids": [1, 2.0, 3]},
    {**GOOD, "token_ids": [1, True, 3]},
    {**GOOD, "probs": [1.0, "0.5", 0.2]},
    {**GOOD, "token_ids": list(range(65)), "probs": None},  # over 64
    {**GOOD, "token_ids": []},
    {**GOOD, "top": [[[1, 1.0]]] * 2},  # lengths differ
    {**GOOD, "top": [[[i, 0.01] for i in range(65)]] * 3},  # one position too wide
    {**GOOD, "tokenizer": ""},
    {**GOOD, "tokenizer": "x" * 129},
    {**GOOD, "tokenizer": "has space"},
    {**GOOD, "tokenizer": "line\u2028sep"},
    {**GOOD, "extra": 1},
    {"token_ids": [1], "probs": [1.0]},  # no tokenizer
])
def test_a_hostile_draft_is_refused_with_its_field_named(bad):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body(bad))
    assert "draft" in str(e.value)


def test_a_good_draft_is_used_only_with_the_same_tokenizer_and_in_the_vocabulary():
    opts = ChatCompletionRequest.model_validate(body(GOOD)).cascade.draft
    assert draft_of(opts, IDENTITY, 100) == Draft((1, 2, 3), (1.0, 0.5, 0.25))
    assert draft_of(opts, "another", 100) is None
    assert draft_of(opts, "", 100) is None  # a server that knows no identity takes none
    with pytest.raises(DraftError, match=r"token_ids\[2\]"):  # our tokenizer, yet token 3 in a 3-token vocabulary
        draft_of(opts, IDENTITY, 3)
    assert draft_of(None, IDENTITY, 100) is None


def test_the_devices_distribution_is_known_only_where_it_was_sent_whole():
    assert Draft((1, 2), (1.0, 1.0)).distributions() == [{1: 1.0}, {2: 1.0}]  # a greedy device
    assert Draft((1, 2), (1.0, 0.5)).distributions() is None  # sampled, its distribution not sent
    assert Draft((1,), (0.5,), (((1, 0.5), (2, 0.5)),)).distributions() == [{1: 0.5, 2: 0.5}]
    assert Draft((1,), (0.5,), (((1, 0.5), (2, 0.4)),)).distributions() is None  # a tail is missing


def test_the_request_record_carries_the_draft_to_the_worker_strictly():
    draft = Draft((5, 6), (1.0, 0.75), (((5, 1.0),), ((6, 0.75), (7, 0.25))))
    record = RequestRecord(request_id="r", prompt_token_ids=[1, 2], sampling={}, **draft_fields(draft))
    back = decode(encode(record))
    assert back.draft() == draft
    assert RequestRecord(request_id="r", prompt_token_ids=[1], sampling={}).draft() is None
    frame = encode(record).replace(b'"draft_probs":[1.0,0.75]', b'"draft_probs":[1.0,7.5]')
    with pytest.raises(ValueError):
        decode(frame)


def test_the_edge_drafts_only_a_greedy_answer_it_can_name_the_tokenizer_of():
    events = [TokenEvent(token_id=7, text="a", piece=b"a", logprob=-0.1, entropy=0.5),
              TokenEvent(token_id=8, text="b", piece=b"b", logprob=-2.0, entropy=1.5), Finish("stop", 3, 2)]
    assert edge_draft_of(events, IDENTITY, True) == {"token_ids": [7, 8], "probs": [1.0, 1.0], "tokenizer": IDENTITY}
    assert edge_draft_of(events, IDENTITY, False) is None
    assert edge_draft_of(events, "", True) is None
    assert edge_draft_of([Finish("stop", 3, 0)], IDENTITY, True) is None


class RecordingCloud:
    """A cloud that lists one model (with or without a tokenizer) and records what it is asked."""

    def __init__(self, tokenizer: str | None):
        self.tokenizer = tokenizer
        self.bodies: list[dict] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            card = {"id": "cloud-m", "object": "model", "created": 0, "owned_by": "cascade", "meta": {}}
            if self.tokenizer is not None:
                card["meta"]["tokenizer"] = self.tokenizer
            return httpx.Response(200, json={"object": "list", "data": [card]})
        self.bodies.append(json.loads(request.content))
        chunk = {"id": "c", "object": "chat.completion.chunk", "model": "cloud-m",
                 "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")


def sent(tokenizer: str | None, model: str = "") -> dict:
    cloud = RecordingCloud(tokenizer)
    up = Upstream(UpstreamConfig(url="http://cloud.test", model=model), device="d1")
    up.client = httpx.AsyncClient(transport=httpx.MockTransport(cloud.handle), headers=up.client.headers)

    async def go():
        app_body = {"messages": [{"role": "user", "content": "hi"}], "cascade": {"mode": "auto"}}
        esc = await up.escalate("chat", app_body, "low_confidence",
                                {"token_ids": [1, 2], "probs": [1.0, 1.0], "tokenizer": IDENTITY}, retries=0)
        [e async for e in esc.events]
        await up.close()
    asyncio.run(go())
    (body,) = cloud.bodies
    return body


@pytest.mark.parametrize("model", ["", "cloud-m"])  # the model listed, or named in [upstream] model
def test_the_draft_goes_only_to_a_cloud_that_names_the_same_tokenizer(model):
    assert sent(IDENTITY, model)["cascade"] == {"draft": {"token_ids": [1, 2], "probs": [1.0, 1.0],
                                                          "tokenizer": IDENTITY}}
    assert "cascade" not in sent("another-tokenizer", model)  # never the app's own cascade options either
    assert "cascade" not in sent(None, model)  # a cloud that names none (vLLM, OpenAI) gets a plain request


@pytest.mark.parametrize("counts", [[3], [1, 2], [65, 1], [-1, 0], ["8", 4], [True, 0], [2**70, 1], {"o": 1}])
def test_a_workers_draft_counts_are_checked_before_they_reach_a_counter(counts):
    from cascade.generation import event_from_wire

    with pytest.raises(ValueError):
        event_from_wire({"finish": ["stop", 3, 2, 0, ""], "draft": counts})


def test_draft_counts_travel_from_the_worker_into_the_answer():
    from cascade.generation import event_from_wire, event_to_wire
    from cascade.openai_format import cascade_of

    fin = event_from_wire(event_to_wire(Finish("stop", 10, 9, draft_offered=8, draft_accepted=5)))
    assert (fin.draft_offered, fin.draft_accepted) == (8, 5)
    assert cascade_of({"tier": "cloud"}, fin) == {"tier": "cloud", "draft": {"offered": 8, "accepted": 5}}
    assert cascade_of(None, Finish("stop", 1, 1)) is None


@pytest.mark.parametrize("said, seen", [({"offered": 8, "accepted": 5}, (8, 5)),
                                        ({"offered": 2**40, "accepted": 2**40}, (64, 64)),  # clamped
                                        ({"offered": 4, "accepted": 9}, (4, 4)),
                                        ({"offered": -3, "accepted": -1}, (0, 0)),
                                        ({"offered": "8", "accepted": 5}, (0, 0)),  # ignored
                                        ("junk", (0, 0))])
def test_the_edge_reads_what_the_cloud_says_of_its_draft_clamped(said, seen):
    async def handle(request: httpx.Request) -> httpx.Response:
        chunk = {"id": "c", "object": "chat.completion.chunk", "model": "cloud-m", "cascade": {"draft": said},
                 "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")

    up = Upstream(UpstreamConfig(url="http://cloud.test", model="cloud-m"), device="d1")
    up.client = httpx.AsyncClient(transport=httpx.MockTransport(handle), headers=up.client.headers)

    async def go():
        esc = await up.escalate("chat", {"messages": [{"role": "user", "content": "hi"}]}, "forced", retries=0)
        events = [e async for e in esc.events]
        await up.close()
        return events[-1]
    fin = asyncio.run(go())
    assert (fin.draft_offered, fin.draft_accepted) == seen


# -- the door, attacked: whatever a client sends as cascade.draft is a 4xx or a draft the engine can take --

_NUMS = ["0", "1", "-1", "0.5", "1.0", "2", "1e400", "NaN", "Infinity", "-0.0", "2147483647", "2147483648",
         "9223372036854775808", "1e-320", "true", "null", '"3"', "[]", "{}"]


def _draft_bodies():
    num = st.sampled_from(_NUMS)
    arr = st.lists(num, max_size=6).map(lambda xs: "[" + ",".join(xs) + "]")
    pairs = st.lists(st.lists(num, min_size=0, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]"), max_size=3)
    top = st.lists(pairs.map(lambda xs: "[" + ",".join(xs) + "]"), max_size=6).map(lambda xs: "[" + ",".join(xs) + "]")
    tok = st.sampled_from(['"' + IDENTITY + '"', '""', '"a b"', '"\\u2028"', "1", "null", '"' + "z" * 200 + '"'])
    ids = st.lists(st.sampled_from(["0", "1", "7", "2147483647"]), min_size=1, max_size=3)
    probs = st.lists(st.sampled_from(["0", "1", "1.0", "0.25"]), min_size=1, max_size=3)
    fields = st.fixed_dictionaries(
        {"token_ids": st.one_of(ids.map(lambda xs: "[" + ",".join(xs) + "]"), arr),
         "tokenizer": st.one_of(st.just('"' + IDENTITY + '"'), tok)},
        optional={"probs": st.one_of(probs.map(lambda xs: "[" + ",".join(xs) + "]"), arr, st.just("null")),
                  "top": st.one_of(top, st.just("null")), "junk": num})
    return fields.map(lambda d: '{"model":"m","messages":[{"role":"user","content":"hi"}],"cascade":{"draft":{'
                      + ",".join(f'"{k}":{v}' for k, v in d.items()) + "}}}")


def test_any_draft_a_client_sends_is_a_4xx_or_one_the_engine_can_take():
    app, passed, accepted = FastAPI(), [], [0]
    install_error_handlers(app)

    @app.post("/chat")
    async def chat(request: Request):
        passed.append(parse_body(ChatCompletionRequest, await read_json(request, 1 << 20)))
        return {}

    client = TestClient(app, raise_server_exceptions=False)

    @settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(_draft_bodies())
    def run(raw):
        passed.clear()
        r = client.post("/chat", content=raw.encode(), headers={"content-type": "application/json"})
        assert r.status_code in (200, 400, 422), (r.status_code, r.text)
        if r.status_code != 200:
            assert r.json()["error"]["message"]
            return
        accepted[0] += 1
        try:
            draft = draft_of(passed[0].cascade.draft, IDENTITY, 2**31)
        except DraftError:  # the gateway's 400 naming the field
            return
        if draft is not None:  # the engine's invariants hold for whatever passed
            assert 1 <= len(draft.token_ids) <= 64 and all(0 <= t < 2**31 for t in draft.token_ids)
            assert all(0.0 <= p <= 1.0 for p in draft.probs or ())
            assert draft.probs is None or len(draft.probs) == len(draft.token_ids)
            RequestRecord.model_validate_json(RequestRecord(request_id="r", prompt_token_ids=[1], sampling={},
                                                            **draft_fields(draft)).model_dump_json())
    run()
    assert accepted[0] >= 5, "no generated draft passed: the invariants were never checked"
