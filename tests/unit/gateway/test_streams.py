"""A flight's event stream: the first event read before a status is chosen, a failure told from
a client that left, and a worker's refusal mapped to the gateway's answer."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from cascade import errors
from cascade.generation import Finish, TokenEvent
from cloud_tier.gateway.http.sse import pull_first
from cloud_tier.gateway.pipeline.flight import Flight
from cloud_tier.gateway.pipeline.recorder import Recorder
from cloud_tier.gateway.pipeline.settlement import outcome_of, tokens_used
from cloud_tier.gateway.tenants.keys import ApiKey
from cloud_tier.gateway.workers.stream import error_of

TOKEN = TokenEvent(token_id=1, text="a", piece=b"a", logprob=0.0, entropy=0.0)
FINISH = Finish("stop", 3, 1)


def flight() -> Flight:
    key = ApiKey("abcdefgh", "acme", None, frozenset({"infer"}), 0.0, 0.0, 0.0)
    return Flight("acme", key, "chat", 0.0)


async def events(*items, delay_s: float = 0.0):
    for item in items:
        await asyncio.sleep(delay_s)
        if isinstance(item, BaseException):
            raise item
        yield item


def recorded(source) -> tuple[Recorder, list[Flight]]:
    settled: list[Flight] = []

    async def settle(f: Flight) -> None:
        settled.append(f)

    return Recorder(source, flight(), settle), settled


async def never_disconnected() -> bool:
    return False


async def disconnected() -> bool:
    return True


def test_the_first_event_is_passed_on_with_the_rest():
    async def run():
        rec, settled = recorded(events(TOKEN, FINISH))
        stream = await pull_first(rec, never_disconnected)
        got = [ev async for ev in stream]
        await stream.aclose()
        return got, settled
    got, settled = asyncio.run(run())
    assert got == [TOKEN, FINISH]
    assert settled[0].finish == FINISH and settled[0].error is None and settled[0].generated_tokens == 1


def test_a_failure_before_the_first_event_raises_and_settles_as_that_failure():
    refusal = errors.APIError(503, "no room", "server_error", code="no_capacity")

    async def run():
        rec, settled = recorded(events(refusal))
        with pytest.raises(errors.APIError) as e:
            await pull_first(rec, never_disconnected)
        return e.value, settled
    raised, settled = asyncio.run(run())
    assert raised is refusal
    assert len(settled) == 1 and settled[0].error is refusal and outcome_of(settled[0].error) == "5xx"


def test_a_client_that_leaves_before_the_first_event_gets_none_and_nothing_is_a_failure():
    async def run():
        rec, settled = recorded(events(TOKEN, FINISH, delay_s=5.0))
        return await pull_first(rec, disconnected, poll_s=0.01), settled
    stream, settled = asyncio.run(run())
    assert stream is None
    assert len(settled) == 1 and settled[0].error is None and settled[0].finish is None


def test_a_failure_after_tokens_is_recorded_as_the_streams_error():
    async def run():
        rec, settled = recorded(events(TOKEN, TOKEN, RuntimeError("cut")))
        with pytest.raises(RuntimeError):
            async for _ in rec:
                pass
        await rec.aclose()
        return settled
    settled = asyncio.run(run())
    assert isinstance(settled[0].error, RuntimeError) and settled[0].generated_tokens == 2


@pytest.mark.parametrize("status,body,headers,want", [
    pytest.param(400, {"error": {"message": "bad", "type": "invalid_request_error", "param": "stop_token_ids",
                                 "code": "invalid_value"}}, {}, (400, "invalid_value", "stop_token_ids", None),
                 id="400-passes-through"),
    pytest.param(413, {"error": {"message": "big", "code": "request_too_large"}}, {},
                 (413, "request_too_large", None, None), id="413-passes-through"),
    pytest.param(401, {"error": {"message": "no", "code": "invalid_api_key"}}, {},
                 (502, "worker_refused_gateway", None, None), id="401-is-the-gateways-credentials"),
    pytest.param(503, {"error": {"message": "full", "code": "no_capacity"}}, {},
                 (503, "no_capacity", None, "1"), id="503-gets-retry-after"),
    pytest.param(503, {"error": {"message": "full", "code": "no_capacity"}}, {"retry-after": "7"},
                 (503, "no_capacity", None, "7"), id="503-keeps-the-workers-retry-after"),
    pytest.param(500, b"<html>", {}, (502, "worker_error", None, None), id="not-json-is-a-502"),
    pytest.param(500, {"error": {"message": "boom", "type": "server_error", "code": "internal_error"}}, {},
                 (502, "internal_error", None, None), id="a-workers-500-is-a-502-never-the-gateways-500"),
    pytest.param(504, {"error": {"message": "slow", "code": "timeout"}}, {}, (504, "timeout", None, None),
                 id="504-passes-through"),
])
def test_a_workers_refusal_becomes_the_gateways_answer(status, body, headers, want):
    import json

    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    err = error_of(content, status, httpx.Headers(headers))
    assert (err.status, err.code, err.param, err.headers.get("Retry-After")) == want


@pytest.mark.parametrize("finish,error,generated,charged", [
    pytest.param(Finish("length", 10, 50), None, 50, 60, id="finished: prompt + completion"),
    pytest.param(None, None, 30, 40, id="client left: prompt + tokens generated"),
    pytest.param(None, None, 0, 10, id="client left before the first token: the prompt"),
    pytest.param(None, RuntimeError("cut"), 30, 30, id="cloud failed: only the tokens received"),
])
def test_what_a_flight_is_charged(finish, error, generated, charged):
    f = flight()
    f.prompt_tokens, f.finish, f.error, f.generated_tokens = 10, finish, error, generated
    assert tokens_used(f) == charged
