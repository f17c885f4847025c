"""Every transport test: no shared-memory segment outlives it."""

import pytest

from tests.unit.disagg.transport_helpers import segments


@pytest.fixture(autouse=True)
def no_segment_outlives_a_test():
    before = segments()
    yield
    assert segments() - before == set()
