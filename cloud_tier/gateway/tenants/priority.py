"""A request's priority class at the gateway: ``interactive`` unless it asks for a lower one
(``X-Cascade-Priority`` or the body's ``priority_class``, the lower of the two); the edge agent's escalations ask for
``escalation``, the Batch API's lines run as ``batch``. Every class is at or below the default,
so a request can only lower its own standing. The class travels to our workers in the
``RequestRecord`` (the engine serves interactive first and preempts batch first) and, where
``[gateway] foreign_priority`` is on, to vLLM workers as their integer ``priority``."""

from __future__ import annotations

from cloud_tier.request_builder import priority_class_of

HEADER = "x-cascade-priority"
# vLLM's --scheduling-policy priority serves lower numbers first
VLLM_PRIORITY = {"interactive": 0, "escalation": 1, "batch": 2}
priority_class = priority_class_of  # the rule the workers apply too


def with_vllm_priority(body: dict, priority_class: str) -> dict:
    """``body`` for a vLLM worker started with ``--scheduling-policy priority``: its class as
    vLLM's ``priority``, unless the client set one itself."""
    if "priority" in body:
        return body
    return {**body, "priority": VLLM_PRIORITY[priority_class]}
