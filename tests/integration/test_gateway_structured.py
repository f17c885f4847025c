"""Structured outputs and tool calls through the cloud tier (issue 41): the gateway in front of our
engine (`cascade cloud serve --both 1`, SmolLM2), through the official client. The engine holds each
answer to its grammar; the gateway refuses what cannot be enforced before routing, and its result
cache keys on the contract."""

from __future__ import annotations

import json
from enum import StrEnum

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import create_key

MODEL = "smollm2-135m"
TOOLS = [{"type": "function", "function": {"name": "open_door", "description": "Open a door of the kiosk",
                                           "parameters": {"type": "object", "properties": {
                                               "door_id": {"type": "integer", "minimum": 1, "maximum": 9}},
                                               "required": ["door_id"]}}},
         {"type": "function", "function": {"name": "lookup_order", "description": "Look up an order",
                                           "parameters": {"type": "object", "properties": {
                                               "order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"}},
                                               "required": ["order_id"]}}}]


class Mood(StrEnum):
    happy = "happy"
    sad = "sad"


class Reading(BaseModel):
    sensor: str = Field(max_length=20)
    celsius: float = Field(ge=-50, le=150)
    mood: Mood
    taken: str = Field(json_schema_extra={"format": "date-time"})
    alerts: list[str] = Field(max_length=2)


@pytest.fixture(scope="module")
def gw(engine_home, cloud_both):
    key = create_key(engine_home, "--tenant", "structured-gw")
    return openai.OpenAI(base_url=f"{cloud_both.url}/v1", api_key=key, max_retries=0, timeout=180)


def test_parse_through_the_gateway(gw):
    r = gw.beta.chat.completions.parse(model=MODEL, response_format=Reading, temperature=0, max_tokens=160,
                                       messages=[{"role": "user", "content": "A sensor reading, please."}])
    assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, Reading)


def test_a_streamed_named_call_through_the_gateway(gw):
    calls = {}
    for chunk in gw.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Where is order AB1234?"}], tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "lookup_order"}}, temperature=0, max_tokens=60,
            stream=True):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
    [(name, args)] = calls.values()
    assert name == "lookup_order"
    jsonschema.validate(json.loads(args), TOOLS[1]["function"]["parameters"])


@pytest.mark.parametrize("extra, param, code", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}},
     "response_format.json_schema.schema", "unsupported_schema_keyword"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}},
     "response_format.json_schema.schema", "invalid_schema"),
    ({"tools": TOOLS, "tool_choice": "anything"}, "tool_choice", "invalid_value"),
    ({"response_format": {"type": "protobuf"}}, "response_format.type", "invalid_value"),
])
def test_what_cannot_be_enforced_is_a_400_before_routing(gw, extra, param, code):
    with pytest.raises(openai.BadRequestError) as refused:
        gw.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                   extra_body=extra)
    assert (refused.value.body["param"], refused.value.body["code"]) == (param, code)


def test_the_result_cache_keys_on_the_contract(gw):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a door."}], temperature=0, max_tokens=40)
    a = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "blue"]}}, "required": ["color"]}
    b = {"type": "object", "properties": {"width_cm": {"type": "integer"}}, "required": ["width_cm"]}
    first = gw.chat.completions.with_raw_response.create(
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": a}}, **ask)
    again = gw.chat.completions.with_raw_response.create(
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": a}}, **ask)
    other = gw.chat.completions.with_raw_response.create(
        response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": b}}, **ask)
    assert [r.headers["x-cascade-cache"] for r in (first, again, other)] == ["miss", "hit", "miss"]
    jsonschema.validate(json.loads(other.parse().choices[0].message.content), b)
    free = gw.chat.completions.with_raw_response.create(**ask)
    assert free.headers["x-cascade-cache"] == "miss"
