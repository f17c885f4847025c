"""Which refusals use up a batch line's ``max_refusals``: its own (a quota, a budget, its SLO) do;
the pool's capacity (no workers, saturated, no KV room) only backs off, so an overloaded pool never
fails lines that would run once it has room (the completion window still ends them)."""

from __future__ import annotations

import pytest

from cloud_tier.gateway.batch.runner import BatchRunner, RunnerConfig


def refusal(status: int, code: str) -> dict:
    return {"error": {"message": "refused", "type": "rate_limit_error", "code": code}}


@pytest.fixture
def runner() -> BatchRunner:
    return BatchRunner(svc=None, store=None, config=RunnerConfig(max_refusals=3))


@pytest.mark.parametrize("status, code", [(503, "no_workers"), (429, "pool_saturated"), (429, "kv_capacity"),
                                          (503, "no_capacity")])
def test_the_pools_capacity_backs_off_without_using_up_the_lines_refusals(runner, status, code):
    line = ("b1", 0)
    assert all(runner._passes(line, status, refusal(status, code)) for _ in range(50))
    assert runner.refusals[line] == 0 and runner.pool_waits[line] == 50


@pytest.mark.parametrize("code", ["slo", "budget_exceeded", "rate_limit_exceeded"])
def test_the_lines_own_refusals_end_it_after_max_refusals(runner, code):
    line = ("b1", 1)
    assert [runner._passes(line, 429, refusal(429, code)) for _ in range(3)] == [True, True, False]


def test_a_refusal_that_never_passes_ends_the_line_at_once(runner):
    assert not runner._passes(("b1", 2), 429, refusal(429, "tokens_exceed_quota"))
