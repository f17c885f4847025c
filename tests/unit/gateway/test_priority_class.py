"""A request's priority class at the gateway: interactive unless it asks for another, the lower
standing of the body's field and the header; anything else a 400 naming where it came from; vLLM's integer priority
only where the client gave none."""

import pytest

from cascade import errors
from cloud_tier.gateway.tenants.priority import priority_class, with_vllm_priority


@pytest.mark.parametrize("header,body,klass", [
    (None, None, "interactive"),
    ("escalation", None, "escalation"),
    (" Batch ", None, "batch"),
    ("batch", "escalation", "batch"),  # the lower standing of the two
    ("escalation", "interactive", "escalation"),
    (None, "interactive", "interactive"),
])
def test_the_class_a_request_asks_for(header, body, klass):
    assert priority_class(header, body) == klass


@pytest.mark.parametrize("header,body,param", [
    ("urgent", None, "X-Cascade-Priority"),
    ("", None, "X-Cascade-Priority"),
    (None, "Batch", "priority_class"),
    ("batch", 2, "priority_class"),
])
def test_a_class_that_is_none_is_a_400_naming_its_source(header, body, param):
    with pytest.raises(errors.APIError) as e:
        priority_class(header, body)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "invalid_value")


def test_vllm_priority_follows_the_class_unless_the_client_set_one():
    assert with_vllm_priority({"model": "m"}, "batch") == {"model": "m", "priority": 2}
    assert with_vllm_priority({"model": "m"}, "interactive")["priority"] == 0
    assert with_vllm_priority({"model": "m", "priority": 7}, "batch")["priority"] == 7


def test_the_edge_agents_escalations_ask_for_the_escalation_class():
    import asyncio

    from edge_agent.config import UpstreamConfig
    from edge_agent.upstream import Upstream

    up = Upstream(UpstreamConfig(url="http://cloud.invalid"))
    assert priority_class(up.client.headers.get("x-cascade-priority"), None) == "escalation"
    asyncio.run(up.close())
