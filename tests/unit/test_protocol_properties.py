"""Property tests of the request door every server shares (cascade.web: read_json + parse_body on
the protocol models): whatever bytes arrive, the answer is a 2xx or a 4xx with an OpenAI error
body, never a 5xx; and whatever passes is safe downstream: every number finite and within 64
bits (SQLite, numpy, C), every string encodable as UTF-8."""

from __future__ import annotations

import json
import math

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cascade.protocol import INT64, ChatCompletionRequest, CompletionRequest
from cascade.web.app import install_error_handlers
from cascade.web.requests import parse_body, read_json

app = FastAPI()
install_error_handlers(app)
PASSED: list = []
ACCEPTED = [0]  # how many generated bodies of the current run passed validation


@app.post("/chat")
async def _chat(request: Request):
    req = parse_body(ChatCompletionRequest, await read_json(request, 1 << 20))
    PASSED.append(req)
    return {"ok": True}


@app.post("/completions")
async def _completions(request: Request):
    req = parse_body(CompletionRequest, await read_json(request, 1 << 20))
    PASSED.append(req)
    return {"ok": True}


client = TestClient(app, raise_server_exceptions=False)

# numbers as raw JSON text, so the door sees what a hostile client can send
NUMBERS = st.sampled_from(["0", "-1", "1", "0.5", "2", "1e-39", "1e-320", "1e308", "1e400", "-1e400", "NaN",
                           "Infinity", "-Infinity", "4294967295", "9223372036854775807", "9223372036854775808",
                           "1180591620717411303424", "-9223372036854775809", "1.0", "3", "0.009", "1e-7"])
STRINGS = st.one_of(st.text(max_size=40), st.sampled_from(['"\\ud800"', '"a\\udfffb"', '"\\u0000"', '""',
                                                           '"' + "x" * 5000 + '"']))


def raw_string(s: str) -> str:
    return s if s.startswith('"') else json.dumps(s)


SCALARS = st.one_of(NUMBERS, STRINGS.map(raw_string), st.sampled_from(["true", "false", "null"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]"),
    st.dictionaries(STRINGS.map(raw_string), inner, max_size=4).map(
        lambda d: "{" + ",".join(f"{k}:{v}" for k, v in d.items()) + "}")), max_leaves=8)

FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream", "n",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "user", "max_completion_tokens",
          "logprobs", "top_logprobs", "echo", "suffix", "stream_options", "cascade"]
CASCADE_FIELDS = ["mode", "offline", "hint", "latency_budget_s", "session", "refine", "callback_url", "priority",
                  "ttl_s", "modee"]


@st.composite
def bodies(draw, endpoint: str) -> str:
    parts = ['"model":' + draw(st.sampled_from(['"m"'] * 6 + ['""', "1", '"\\ud800"']))]
    if endpoint == "chat":
        content = draw(st.one_of(STRINGS.map(raw_string), STRINGS.map(raw_string), VALUES))
        role = draw(st.sampled_from(['"user"'] * 6 + ['"system"', '"assistant"', '"robot"', "null"]))
        parts.append(f'"messages":[{{"role":{role},"content":{content}}}]')
    else:
        prompt = draw(st.one_of(STRINGS.map(raw_string), VALUES,
                                st.lists(NUMBERS, min_size=1, max_size=4).map(lambda x: "[" + ",".join(x) + "]")))
        parts.append(f'"prompt":{prompt}')
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=5, unique=True)):
        if name == "cascade":
            inner = draw(st.dictionaries(st.sampled_from(CASCADE_FIELDS), st.one_of(NUMBERS, VALUES), max_size=4))
            parts.append('"cascade":{' + ",".join(f'"{k}":{v}' for k, v in inner.items()) + "}")
        else:
            parts.append(f'"{name}":' + draw(st.one_of(NUMBERS, NUMBERS, VALUES)))
    return "{" + ",".join(parts) + "}"


def safe(value, path="") -> None:
    """Every number finite and within 64 bits, every string UTF-8 encodable."""
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        assert INT64[0] <= value <= INT64[1], f"{path}: {value} is out of 64 bits"
    elif isinstance(value, float):
        assert math.isfinite(value), f"{path}: {value}"
    elif isinstance(value, str):
        value.encode("utf-8")
    elif isinstance(value, dict):
        for k, v in value.items():
            safe(v, f"{path}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            safe(v, f"{path}[{i}]")


def check(endpoint: str, body: str) -> None:
    PASSED.clear()
    r = client.post(f"/{endpoint}", content=body.encode("utf-8", "surrogatepass"),
                    headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code != 200:
        err = r.json()["error"]
        assert 400 <= r.status_code < 500 and err["message"] and err["type"], r.text
        return
    (req,) = PASSED
    ACCEPTED[0] += 1
    safe(req.model_dump(), endpoint)
    json.dumps(req.model_dump(), ensure_ascii=False, allow_nan=False).encode("utf-8")


def hostile_bodies(endpoint: str):
    """The property for ``endpoint``: 300 generated bodies, each answered 2xx/4xx and safe if passed."""
    # derandomized: the same 300 bodies on every run and machine. Random ones let the count that
    # passed validation swing from 11 to 34 in 15 runs, so the >= 10 check below failed now and then
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
    @given(bodies(endpoint))
    def run(body):
        check(endpoint, body)

    return run


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bodies_are_answered_2xx_or_4xx_and_what_passes_is_safe(endpoint):
    ACCEPTED[0] = 0
    hostile_bodies(endpoint)()
    assert ACCEPTED[0] >= 10, f"only {ACCEPTED[0]} generated bodies passed validation: the safe() check is not reached"


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_a_4xx(raw):
    r = client.post("/chat", content=raw, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500 and r.json()["error"]["message"]


@pytest.mark.parametrize("endpoint,base", [("chat", '"messages":[{"role":"user","content":"hi"}]'),
                                           ("completions", '"prompt":"hi"')])
@pytest.mark.parametrize("extra", ['"max_completion_tokens":9223372036854775808',  # an unused field: out of 64 bits
                                   '"metadata":{"k":[1,-9223372036854775809]}', '"tag":"a\\ud800"',
                                   '"metadata":{"\\udfff":1}'])
def test_a_passed_through_field_must_still_be_safe(endpoint, base, extra):
    r = client.post(f"/{endpoint}", content=("{" + f'"model":"m",{base},{extra}' + "}").encode(),
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"], r.text


@pytest.mark.parametrize("endpoint,base", [("chat", '"messages":[{"role":"user","content":"hi"}]'),
                                           ("completions", '"prompt":"hi"')])
@pytest.mark.parametrize("depth", [50_000, 900, 40])
def test_a_deeply_nested_extra_field_is_a_4xx(endpoint, base, depth):
    deep = "[" * depth + "]" * depth
    r = client.post(f"/{endpoint}", content=("{" + f'"model":"m",{base},"x":{deep}' + "}").encode(),
                    headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500 and r.json()["error"]["message"], r.text
