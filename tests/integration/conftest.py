"""After every integration test: the servers still running hold nothing (tests/accounting.py).
A test that leaves a slot busy, KV committed or blocks held, a prefill in flight or a shared
memory segment behind fails here, named, instead of slowing or breaking a later test."""

from __future__ import annotations

import os

import pytest

from tests import accounting
from tests.integration.worker_accounting import shm_segments


@pytest.fixture(autouse=True)
def settled_accounts(request):
    before = shm_segments()
    yield
    if os.environ.get("CASCADE_TEST_ACCOUNTING", "1") == "0" or request.node.get_closest_marker("leaves_load"):
        return
    left = accounting.leaks(before)
    if left:
        pytest.fail(f"resources left after {request.node.nodeid}: {left}", pytrace=False)
