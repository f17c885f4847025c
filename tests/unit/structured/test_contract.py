"""The output contract read from an OpenAI body: what is served, and each bad input a 400 naming
its field (issue 41's bad-input list), in bounded time, never another exception."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cascade import errors
from cascade.protocol import ChatCompletionRequest, CompletionRequest
from cascade.structured.contract import MAX_ENUM, contract_of
from cascade.structured.grammar import check, contract_param, grammar_of

TOOL = {"type": "function", "function": {"name": "open_door", "parameters": {
    "type": "object", "properties": {"door": {"type": "integer"}}, "required": ["door"]}}}


def chat(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **extra)


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def refused(req, endpoint="chat") -> errors.APIError:
    with pytest.raises(errors.APIError) as e:
        c = contract_of(req, endpoint)
        check(grammar_of(c), contract_param(c))
    assert e.value.status == 400
    return e.value


def test_text_is_the_default_and_costs_nothing():
    c = contract_of(chat())
    assert not c.structured and grammar_of(c) is None
    assert not contract_of(chat(response_format={"type": "text"}, tool_choice="none")).structured


def test_each_served_shape_has_a_grammar():
    for extra in ({"response_format": {"type": "json_object"}}, {"response_format": schema_format({"type": "object"})},
                  {"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "required"},
                  {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "open_door"}}},
                  {"tools": [TOOL], "parallel_tool_calls": False, "response_format": {"type": "json_object"}}):
        c = contract_of(chat(**extra))
        assert c.structured and c.digest
        check(grammar_of(c), contract_param(c))
        check(grammar_of(c, special_tags=True), contract_param(c))


def test_tool_choice_none_keeps_the_tools_out_of_the_answer():
    c = contract_of(chat(tools=[TOOL], tool_choice="none"))
    assert c.tools and not c.calls_tools and not c.structured


RECURSIVE = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                                "required": ["next"]}}, "$ref": "#/$defs/node"}
TREE = {"$defs": {"node": {"type": "object", "required": ["kids"],
                           "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}  # ends: an empty list of kids


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": schema_format([1, 2])}, "response_format.json_schema.schema"),
    ({"response_format": schema_format({"type": "strnig"})}, "response_format.json_schema.schema"),
    ({"response_format": schema_format({"type": "object", "required": "a"})}, "response_format.json_schema.schema"),
    ({"response_format": schema_format(RECURSIVE)}, "response_format.json_schema.schema"),
    ({"response_format": schema_format({"enum": list(range(10_000))})}, "response_format.json_schema.schema"),
    ({"response_format": schema_format({"type": "array", "uniqueItems": True})}, "response_format.json_schema.schema"),
    ({"response_format": schema_format({"type": "object", "description": "x" * 70_000})},
     "response_format.json_schema.schema"),
    ({"response_format": schema_format({"$ref": "#/$defs/nope", "$defs": {}})}, "response_format.json_schema.schema"),
    ({"response_format": schema_format({"$ref": "https://example.com/s.json"})}, "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "say", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools[0].function.parameters"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "close_door"}}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_a_bad_contract_is_a_400_naming_the_field(extra, param):
    started = time.perf_counter()
    e = refused(chat(**extra))
    assert e.param == param, e.message
    assert time.perf_counter() - started < 2.0


def test_an_unenforceable_keyword_is_named():
    e = refused(chat(response_format=schema_format({"type": "object", "properties": {
        "a": {"type": "array", "uniqueItems": True}}})))
    assert e.code == "unsupported_schema_keyword" and "uniqueItems" in e.message


def test_tools_are_served_on_chat_only():
    e = refused(CompletionRequest(model="m", prompt="hi", tools=[TOOL]), "completions")
    assert e.param == "tools"
    assert contract_of(CompletionRequest(model="m", prompt="hi", response_format={"type": "json_object"}),
                       "completions").format == "json_object"


def test_a_recursive_schema_that_can_end_is_served():
    check(grammar_of(contract_of(chat(response_format=schema_format(TREE)))), "x")


def test_combined_schemas_are_served_as_they_are():
    both = {"type": "object", "properties": {"a": {"type": "integer"}},
            "allOf": [{"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    based = {"$defs": {"base": {"type": "object", "properties": {"id": {"type": "string"}}}},
             "$ref": "#/$defs/base", "properties": {"name": {"type": "string"}}}
    for schema in (both, based):
        check(grammar_of(contract_of(chat(response_format=schema_format(schema)))), "x")


def test_a_pattern_that_backtracks_is_checked_in_bounded_time():
    from cascade.structured.validate import problem

    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a|a|a|a)*b$"}}}
    contract = contract_of(chat(response_format=schema_format(schema)))
    started = time.perf_counter()
    problem(contract, '{"s": "' + "a" * 40 + 'c"}')
    assert time.perf_counter() - started < 1.0
    assert problem(contract, '{"s": "aab"}') == ""
    assert "does not match" in problem(contract, '{"s": "x"}')


def test_a_tool_answer_needs_the_call_it_answers():
    with pytest.raises(ValueError, match="tool_call_id"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])


def test_an_enum_at_the_bound_is_served():
    contract_of(chat(response_format=schema_format({"enum": list(range(MAX_ENUM))})))


json_values = st.recursive(st.none() | st.booleans() | st.integers(-10, 10) | st.text(max_size=5),
                           lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids,
                                                                                     max_size=3), max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(rf=json_values, tools=json_values, choice=json_values)
def test_any_json_is_a_contract_or_a_400(rf, tools, choice):
    extra = {k: v for k, v in (("response_format", rf), ("tools", tools), ("tool_choice", choice)) if v is not None}
    try:
        c = contract_of(chat(**extra))
        check(grammar_of(c), contract_param(c))
    except errors.APIError as e:
        assert e.status == 400 and e.param
