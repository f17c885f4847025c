"""Tool calls in the model's text: parsed the same whatever the text's split into tokens, streamed
as deltas the official client's types accept, and a malformed call kept as content."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from cascade.generation import Finish, TokenEvent
from cascade.openai_format import ChatFormatter
from cascade.protocol import ChatCompletionRequest
from cascade.structured.contract import contract_of
from cascade.structured.tools import StreamedCalls, ToolCallParser
from cascade.structured.validate import problem

ANSWER = ('Sure.\n<tool_call>\n{"name": "open_door", "arguments": {"door": 3}}\n</tool_call>\n'
          '<tool_call>\n{"name": "lookup", "arguments": {"id": "AB12"}}\n</tool_call>')


def parse(pieces) -> tuple[str, list]:
    p = ToolCallParser()
    content = "".join(p.feed(x)[0] for x in pieces) + p.flush()[0]
    return content, [(c.name, json.loads(c.arguments)) for c in p.calls]


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(ANSWER)), max_size=12))
def test_any_split_of_the_text_gives_the_same_calls(cuts):
    bounds = [0, *sorted(cuts), len(ANSWER)]
    pieces = [ANSWER[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert parse(pieces) == parse([ANSWER]) == ("Sure.", [("open_door", {"door": 3}), ("lookup", {"id": "AB12"})])


def test_a_malformed_or_cut_off_call_stays_content():
    p = ToolCallParser()
    text = "<tool_call>\n{not json}\n</tool_call>"
    assert p.feed(text)[0] == text and not p.calls and p.problems
    p = ToolCallParser()
    assert p.feed('<tool_call>\n{"name": "a"')[0] == ""
    assert p.flush()[0] == '<tool_call>\n{"name": "a"' and p.problems


def test_text_that_only_looks_like_a_tag_is_released():
    assert parse(["a <b>", " <tool", "s> c"]) == ("a <b> <tools> c", [])


def events(text: str, size: int = 5) -> list[TokenEvent]:
    return [TokenEvent(1, text[i:i + size], text[i:i + size].encode(), 0.0, 0.0) for i in range(0, len(text), size)]


def test_a_streamed_answer_assembles_into_the_same_calls_as_the_whole_one():
    f = ChatFormatter("m", False, tool_calls=True)
    chunks = [f.first_chunk()] + [c for c in (f.token_chunk(e) for e in events(ANSWER)) if c]
    chunks += f.final_chunks(Finish("stop", 5, 30), False)
    calls, reasons = {}, []
    for block in "".join(chunks).split("\n\n"):
        if block:
            chunk = ChatCompletionChunk.model_validate_json(block.removeprefix("data: "))
            for ch in chunk.choices:
                reasons.append(ch.finish_reason)
                for tc in ch.delta.tool_calls or []:
                    calls[tc.index] = (tc.function.name, json.loads(tc.function.arguments), tc.id)
    whole = ChatCompletion.model_validate(ChatFormatter("m", False, tool_calls=True).response(
        events(ANSWER), Finish("stop", 5, 30)).model_dump())
    assert [c[:2] for c in calls.values()] == [(c.function.name, json.loads(c.function.arguments))
                                               for c in whole.choices[0].message.tool_calls]
    assert reasons[-1] == whole.choices[0].finish_reason == "tool_calls"
    assert len({c[2] for c in calls.values()}) == 2  # ids differ


def test_a_cut_off_answer_finishes_length_with_its_text():
    r = ChatFormatter("m", False, tool_calls=True).response(events('<tool_call>\n{"name": "a'), Finish("length", 5, 9))
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("<tool_call>")


def test_streamed_calls_from_a_cloud_become_the_models_markup():
    s = StreamedCalls()
    s.add([{"index": 0, "id": "c", "function": {"name": "open_door", "arguments": ""}}])
    s.add([{"index": 0, "function": {"arguments": '{"door": '}}])
    s.add([{"index": 0, "function": {"arguments": "3}"}}])
    assert parse(s.take()) == ("", [("open_door", {"door": 3})])
    for bad in ([{"function": {"name": "x"}, "index": "0"}], [{"index": 10**9, "function": {}}], [{"index": 0}]):
        with pytest.raises(ValueError):
            StreamedCalls().add(bad)


TOOLS = [{"type": "function", "function": {"name": "open_door", "parameters": {
    "type": "object", "properties": {"door": {"type": "integer"}}, "required": ["door"]}}}]


@pytest.mark.parametrize("extra, text, ok", [
    ({"response_format": {"type": "json_object"}}, '{"a": 1}', True),
    ({"response_format": {"type": "json_object"}}, '{"a": 1', False),
    ({"response_format": {"type": "json_object"}}, "[1]", False),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": {
        "type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]}}}},
     '{"d": "2024-13-45"}', False),
    ({"tools": TOOLS}, "just text", True),
    ({"tools": TOOLS}, '<tool_call>\n{"name": "open_door", "arguments": {"door": 3}}\n</tool_call>', True),
    ({"tools": TOOLS}, '<tool_call>\n{"name": "open_door", "arguments": {"door": "3"}}\n</tool_call>', False),
    ({"tools": TOOLS}, '<tool_call>\n{"name": "close_door", "arguments": {}}\n</tool_call>', False),
    ({"tools": TOOLS, "tool_choice": "required"}, "no call", False),
    ({"tools": TOOLS, "parallel_tool_calls": False},
     '<tool_call>\n{"name": "open_door", "arguments": {"door": 1}}\n</tool_call>\n'
     '<tool_call>\n{"name": "open_door", "arguments": {"door": 2}}\n</tool_call>', False),
])
def test_an_answer_is_checked_against_its_contract(extra, text, ok):
    contract = contract_of(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **extra))
    assert (problem(contract, text) == "") is ok


def test_a_repeated_call_is_one_and_a_cut_off_repeat_is_dropped():
    call = '<tool_call>\n{"name": "open_door", "arguments": {"door": 3}}\n</tool_call>\n'
    content, calls = parse([call * 3 + '<tool_call>\n{"name": "open_do'])
    assert content == "" and calls == [("open_door", {"door": 3})]


def test_a_close_tag_inside_an_argument_string_does_not_end_the_call():
    text = '<tool_call>\n{"name": "render", "arguments": {"html": "</tool_call> and <tool_call>"}}\n</tool_call>'
    for size in (1, 3, 7, len(text)):
        assert parse([text[i:i + size] for i in range(0, len(text), size)]) == (
            "", [("render", {"html": "</tool_call> and <tool_call>"})])


def test_a_cloud_stream_past_its_bounds_is_refused():
    s = StreamedCalls()
    with pytest.raises(ValueError):
        for _ in range(200):
            s.add([{"index": 0, "function": {"arguments": "x" * 10_000}}])
    s = StreamedCalls()
    s.add([{"index": 0, "function": {"name": "no such tool\n<script>", "arguments": "{}"}}])
    with pytest.raises(ValueError):
        s.take()
