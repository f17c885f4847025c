"""A request's priority class at the gateway: ``interactive`` unless it asks for a lower one
(``X-Cascade-Priority`` or the body's ``priority_class``); the edge agent's escalations ask for
``escalation``, the Batch API's lines run as ``batch``. Every class is at or below the default,
so a request can only lower its own standing. The class travels to our workers in the
``RequestRecord`` (the engine serves interactive first and preempts batch first) and, where
``[gateway] foreign_priority`` is on, to vLLM workers as their integer ``priority``."""

from __future__ import annotations

from cascade import errors

CLASSES = ("interactive", "escalation", "batch")  # served in this order (cloud_tier.engine.request)
HEADER = "x-cascade-priority"
# vLLM's --scheduling-policy priority serves lower numbers first
VLLM_PRIORITY = {"interactive": 0, "escalation": 1, "batch": 2}


def priority_class(header: str | None, body_value: object) -> str:
    """The class a request asks for (the body's field wins over the header); a value that is
    not a class is a 400 naming where it came from."""
    if body_value is not None:
        return _checked(body_value, "priority_class")
    if header is not None:
        return _checked(header.strip().lower(), "X-Cascade-Priority")
    return "interactive"


def _checked(value: object, param: str) -> str:
    if value not in CLASSES:
        raise errors.bad_request(f"Invalid value for '{param}': {value!r}; expected one of {', '.join(CLASSES)}.",
                                 param, "invalid_value")
    return value


def with_vllm_priority(body: dict, priority_class: str) -> dict:
    """``body`` for a vLLM worker started with ``--scheduling-policy priority``: its class as
    vLLM's ``priority``, unless the client set one itself."""
    if "priority" in body:
        return body
    return {**body, "priority": VLLM_PRIORITY[priority_class]}
