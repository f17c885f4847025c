"""The cascade keeps an answer's contract (issue 41): a real edge agent (SmolLM2 on llama.cpp) in front
of a real cloud (`cascade cloud serve --both 1`, our engine), through the official client. A local
answer that breaks its schema escalates "schema_invalid"; a contract the device cannot serve goes up
before generating; a queued request with tools is replayed with them."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests import loopback
from tests.conftest import Agent, create_key
from tests.faults import Proxy
from tests.integration.test_cascade import agent_env as cascade_env
from tests.integration.test_offline import wait_done

MODEL = "smollm2-135m"
# a code no small model writes unasked: free text fails it, the grammar meets it
CODE = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                         "ok": {"type": "boolean"}},
        "required": ["code", "ok"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": CODE, "strict": True}}
TOOLS = [{"type": "function", "function": {"name": "open_door", "description": "Open a door of the kiosk",
                                           "parameters": {"type": "object", "properties": {
                                               "door_id": {"type": "integer", "minimum": 1, "maximum": 9}},
                                               "required": ["door_id"]}}}]


def agent_env(upstream, key: str, **cascade) -> dict:
    """test_cascade's agent environment, with a delivery loop that retries quickly (the queue test)."""
    return {**cascade_env(upstream, key, **cascade), "CASCADE_EDGE_SYNC_BASE_BACKOFF_S": "0.2",
            "CASCADE_EDGE_SYNC_MAX_BACKOFF_S": "1", "CASCADE_EDGE_SYNC_POLL_S": "0.5"}


@pytest.fixture(scope="module")
def free_edge(engine_home, cloud_both):
    """An agent that generates freely (``constrain = false``): the cascade checks its answers."""
    key = create_key(engine_home, "--tenant", "structured", "--device", "kiosk-s1")
    a = Agent(engine_home, "--n-ctx", "512", "--threads", "1",
              env=agent_env(cloud_both, key, device="kiosk-s1", constrain="false")).wait_healthy()
    yield a
    a.stop()


@pytest.fixture(scope="module")
def edge(engine_home, cloud_both):
    key = create_key(engine_home, "--tenant", "structured", "--device", "kiosk-s2")
    a = Agent(engine_home, "--n-ctx", "512", "--threads", "1",
              env=agent_env(cloud_both, key, device="kiosk-s2")).wait_healthy()
    yield a
    a.stop()


def chat(server, **kw):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=180)
    kw.setdefault("messages", [{"role": "user", "content": "Say hello."}])
    return c.chat.completions.with_raw_response.create(model=MODEL, temperature=0, **kw)


def test_a_free_answer_that_breaks_its_schema_escalates_and_the_cloud_keeps_it(free_edge):
    r = chat(free_edge, response_format=FORMAT, max_tokens=60)
    assert (r.headers["x-cascade-tier"], r.headers["x-cascade-reason"]) == ("cloud", "schema_invalid")
    body = r.parse()
    assert body.model_extra["cascade"]["schema_problem"]
    jsonschema.validate(json.loads(body.choices[0].message.content), CODE)  # the cloud held it to the schema


def test_a_free_tool_call_that_breaks_its_parameters_escalates(free_edge):
    r = chat(free_edge, messages=[{"role": "user", "content": "Open door 3."}], tools=TOOLS, tool_choice="required",
             max_tokens=60)
    assert (r.headers["x-cascade-tier"], r.headers["x-cascade-reason"]) == ("cloud", "schema_invalid")
    [call] = r.parse().choices[0].message.tool_calls[:1]
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])


def test_a_constrained_answer_is_kept_on_the_device(edge):
    r = chat(edge, response_format=FORMAT, max_tokens=60)
    assert (r.headers["x-cascade-tier"], r.headers["x-cascade-reason"]) == ("edge", "easy")
    jsonschema.validate(json.loads(r.parse().choices[0].message.content), CODE)


def test_a_cut_off_answer_escalates_too(edge):
    r = chat(edge, response_format=FORMAT, max_tokens=4)  # too few tokens for any instance
    assert r.headers["x-cascade-reason"] == "schema_invalid"


def test_a_contract_the_device_cannot_enforce_goes_up_before_generating(edge):
    unique = {"type": "json_schema", "json_schema": {"name": "tags", "schema": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}
    with pytest.raises(openai.BadRequestError) as refused:  # the cloud's engine cannot either: its 400 comes back
        chat(edge, response_format=unique, max_tokens=8)
    assert "uniqueItems" in refused.value.body["message"]


def test_tools_too_large_for_the_device_go_up(edge):
    big = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Does one thing. " * 12,
                                             "parameters": TOOLS[0]["function"]["parameters"]}} for i in range(6)]
    r = chat(edge, messages=[{"role": "user", "content": "Use tool_2 on door 4."}], tools=big, tool_choice="required",
             max_tokens=60)
    assert (r.headers["x-cascade-tier"], r.headers["x-cascade-reason"]) == ("cloud", "too_long")
    assert r.parse().choices[0].message.tool_calls


def test_a_queued_request_with_tools_is_replayed_with_them(tmp_path, engine_home, cloud_both):
    proxy = Proxy(cloud_both.port)  # down: the cloud cannot be reached
    key = create_key(engine_home, "--tenant", "structured-q", "--device", "kiosk-s3")
    agent = Agent(tmp_path, "--n-ctx", "512", "--threads", "1",
                  env={**agent_env(proxy, key, device="kiosk-s3", offline="queue"),
                       "CASCADE_EDGE_UPSTREAM_MAX_BACKOFF_S": "1"}).wait_healthy()
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Open door 3."}], "max_tokens": 40,
                "temperature": 0, "tools": TOOLS, "tool_choice": "required", "cascade": {"mode": "cloud"}}
        r = loopback.post(f"{agent.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 202, r.text
        proxy.up()
        done = wait_done(agent, [r.json()["id"]])[r.json()["id"]]
        assert done["state"] == "done"
        choice = done["response"]["choices"][0]
        assert choice["finish_reason"] in ("tool_calls", "length")  # a small model may repeat its call until its limit
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "open_door"
    finally:
        agent.stop()
        proxy.down()
