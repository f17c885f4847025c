"""Structured outputs and tool calls on the edge agent (issue 41), through the official client on
SmolLM2 (llama.cpp), with no cloud: JSON answers held to their schema by the token mask, tool calls
assembled by the client, streamed or not, and each bad contract a 400 naming its field."""

from __future__ import annotations

import datetime
import json
from enum import StrEnum

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "smollm2-135m"
TOOLS = [
    {"type": "function", "function": {"name": "open_door", "description": "Open one of the kiosk's doors",
                                      "parameters": {"type": "object", "properties": {
                                          "door_id": {"type": "integer", "minimum": 1, "maximum": 9},
                                          "unlock": {"type": "boolean"}}, "required": ["door_id"]}}},
    {"type": "function", "function": {"name": "lookup_order", "description": "Look up an order by its id",
                                      "parameters": {"type": "object", "properties": {
                                          "order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"}},
                                          "required": ["order_id"]}}},
]
ASK = [{"role": "user", "content": "Open door 3 and look up order AB1234."}]


class Size(StrEnum):
    small = "small"
    large = "large"


class Address(BaseModel):
    city: str = Field(max_length=40)
    postcode: str = Field(pattern=r"^[0-9]{5}$")


class Order(BaseModel):
    customer: str = Field(max_length=40)
    size: Size
    quantity: int = Field(ge=1, le=20)
    delivery: datetime.date
    address: Address  # a $ref to $defs
    extras: list[str] = Field(max_length=3)
    note: str | None = Field(max_length=40)  # anyOf [string, null]


def test_parse_with_a_pydantic_model_gives_a_valid_instance(client):
    r = client.beta.chat.completions.parse(model=MODEL, response_format=Order, temperature=0, max_tokens=200,
                                           messages=[{"role": "user", "content": "A pizza order, please."}])
    assert r.choices[0].finish_reason == "stop"
    order = r.choices[0].message.parsed
    assert isinstance(order, Order) and isinstance(order.address, Address)


def test_a_sampled_answer_keeps_to_the_schema_too(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "score": {"type": "number", "minimum": 0, "maximum": 1}},
              "required": ["answer", "score"], "additionalProperties": False}
    for seed in (1, 2):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Is the sky green?"}], temperature=1.0, seed=seed,
            max_tokens=60, response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_on_completions(client):
    r = client.completions.create(model=MODEL, prompt="A JSON object describing a cat:", max_tokens=80, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # cut off by max_tokens: still a prefix the grammar allowed
        assert r.choices[0].text.lstrip().startswith("{")


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_a_required_call_meets_its_parameters(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=120)
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    calls = calls_of(r.choices[0].message)
    assert calls
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for name, args in calls:
        jsonschema.validate(args, by_name[name])


def test_a_named_call_is_that_function_and_one_call(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80,
                                       tool_choice={"type": "function", "function": {"name": "lookup_order"}})
    assert r.choices[0].finish_reason == "tool_calls"
    [(name, args)] = calls_of(r.choices[0].message)
    assert name == "lookup_order" and len(args["order_id"]) == 6


def test_a_streamed_call_is_assembled_by_the_client_as_the_whole_answer(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120,
                  parallel_tool_calls=True)
    whole = client.chat.completions.create(**kwargs)
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == calls_of(whole.choices[0].message)
    assert finish == whole.choices[0].finish_reason


def test_a_tool_result_sent_back_is_answered(client):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "lookup_order", "arguments": '{"order_id": "AB1234"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "shipped"}'}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=40)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.choices[0].message.content or r.choices[0].message.tool_calls


def test_tool_choice_none_never_calls(client):
    for prompt in ("Open door 3.", "Look up order AB1234.", "Call open_door with door_id 2."):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=30)
        assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls"


SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "enum": [f"v{i}" for i in range(10_000)]}}}}, "response_format.json_schema.schema"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
])
def test_a_bad_contract_is_a_400_naming_it_and_holds_nothing(agent, client, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body=extra)
    error = refused.value.body
    assert error["param"] == param, error
    if "uniqueItems" in json.dumps(extra):
        assert "uniqueItems" in error["message"]
    health = httpx.get(f"{agent.url}/healthz", timeout=10).json()
    assert health["slots"]["busy"] == 0 and health["slots"]["waiting"] == 0


def test_tools_on_completions_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"tools": TOOLS})
    assert refused.value.body["param"] == "tools"


def test_what_changes_nothing_is_still_served(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       temperature=0, response_format={"type": "text"}, tool_choice="none")
    assert r.choices[0].finish_reason in ("stop", "length")
