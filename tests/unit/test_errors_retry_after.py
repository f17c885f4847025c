"""Retry-After is whole seconds rounded up, at least 1 and at most a day, whatever the wait computed."""

import pytest

from cascade.errors import too_many_requests


@pytest.mark.parametrize(("wait_s", "header"), [(3.0005, "4"), (3.0, "3"), (0.0, "1"), (-5.0, "1"), (0.2, "1"),
                                                (1e12, "86400"), (float("inf"), "86400"), (float("nan"), "86400")])
def test_retry_after_is_whole_seconds_rounded_up_within_a_day(wait_s, header):
    assert too_many_requests("slow down", wait_s).headers["Retry-After"] == header
