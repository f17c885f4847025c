"""OpenAI parameters the edge agent does not serve yet are a 400 naming them, never silently
ignored (issue 37 item 17): the official client against a real agent."""

from __future__ import annotations

import openai
import pytest

MODEL = "smollm2-135m"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}


@pytest.mark.parametrize("extra, param", [
    ({"tools": [TOOL]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": SCHEMA}, "response_format"),
])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_an_unserved_parameter_is_a_400_naming_it(client, endpoint, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=extra)
    error = refused.value.body
    assert error["param"] == param and error["code"] == "unsupported_parameter" and param in error["message"]


def test_what_changes_nothing_is_still_served(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       temperature=0, response_format={"type": "text"}, tool_choice="none")
    assert r.choices[0].finish_reason in ("stop", "length")
