"""A request's engine priority: its key's, or a later one (a larger number) it asks for."""

import pytest

from cascade import errors
from cloud_tier.gateway.pipeline.service import request_priority
from cloud_tier.gateway.tenants.keys import ApiKey


def key(priority: int) -> ApiKey:
    return ApiKey("abcdefgh", "acme", None, frozenset({"infer"}), 0.0, 0.0, 0.0, priority=priority)


@pytest.mark.parametrize("key_priority,requested,runs_at", [
    (0, None, 0),
    (5, None, 5),
    (5, 5, 5),
    (5, 7, 7),
    (-3, -1, -1),
    (0, 2**31 - 1, 2**31 - 1),
])
def test_a_request_runs_at_its_keys_priority_or_a_later_one(key_priority, requested, runs_at):
    assert request_priority(key(key_priority), requested) == runs_at


@pytest.mark.parametrize("key_priority,requested,code", [
    (0, -1_000_000_000, "priority_not_allowed"),  # would jump ahead of (and preempt) every other tenant
    (5, 4, "priority_not_allowed"),
    (0, 2**31, "invalid_value"),
    (0, -(2**31) - 1, "invalid_value"),
    (0, 1.5, "invalid_value"),
    (0, float("inf"), "invalid_value"),
    (0, True, "invalid_value"),
    (0, "high", "invalid_value"),
    (0, [1], "invalid_value"),
])
def test_a_request_may_not_run_ahead_of_its_key_nor_out_of_bounds(key_priority, requested, code):
    with pytest.raises(errors.APIError) as e:
        request_priority(key(key_priority), requested)
    assert (e.value.status, e.value.param, e.value.code) == (400, "priority", code)
