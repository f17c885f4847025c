"""One tenant's service-level parameters never throttle another's requests (issue 37 item 3): a
TPOT target below what the engine serves for everyone is served at that floor, a tenant's TPOT
targets bound only its own requests' slots, and a request its own target keeps out of the batch
does not hold up the queue behind it. Pure scheduler tables: no torch, a fake clock and a fixed
step-cost model."""

import pytest

from cloud_tier.engine.scheduling.tenants import TpotPolicy
from cloud_tier.engine_config import SchedulerConfig
from tests.unit.engine.test_slo_scheduler import fixed_cost, make, req, step

# a step: 10 ms + 1 ms per prefill token + 10 ms per decode; 8 decodes take 90 ms


def test_a_target_below_the_engines_floor_is_served_at_the_floor():
    s, _ = make(max_seqs=32, tpot_min_batch=8)
    tight = req(s, "a", 4, tpot_s=0.001, tenant="a")
    assert s.tpot_target(tight) == pytest.approx(0.01 + 8 * 0.01)  # a step of 8 decodes
    loose = req(s, "b", 4, tpot_s=0.5, tenant="b")
    assert s.tpot_target(loose) == 0.5
    s2, _ = make(max_seqs=32, tpot_min_batch=1, min_tpot_s=0.2)  # a configured floor above the derived one
    assert s2.tpot_target(req(s2, "c", 4, tpot_s=0.05)) == 0.2


def test_one_tenants_tight_tpot_target_does_not_cap_another_tenants_slots():
    s, _ = make(num_blocks=256, budget=512, max_seqs=32)
    s.add_request(req(s, "a", 4, max_tokens=60, tpot_s=0.001, tenant="a"))
    step(s)
    for i in range(6):
        s.add_request(req(s, f"b{i}", 4, max_tokens=20, start=100 + 10 * i, tenant="b"))
    plan, _ = step(s)
    assert {f"b{i}" for i in range(6)} <= set(plan) and s.num_waiting == 0


def test_a_tenants_targets_still_bound_its_own_batch():
    s, _ = make(num_blocks=256, budget=512, max_seqs=32, tpot_min_batch=1)  # decodes_within(0.05) = 4
    for i in range(6):
        s.add_request(req(s, f"r{i}", 4, max_tokens=50, start=10 + 10 * i, tpot_s=0.05, tenant="a"))
    plan, _ = step(s)
    assert len(plan) == 4 and s.num_waiting == 2
    # ... and never below the guaranteed batch: the same targets with tpot_min_batch 5 run 5
    s, _ = make(num_blocks=256, budget=512, max_seqs=32, tpot_min_batch=5)
    for i in range(6):
        s.add_request(req(s, f"r{i}", 4, max_tokens=50, start=10 + 10 * i, tpot_s=0.05, tenant="a"))
    plan, _ = step(s)
    assert len(plan) == 5


def test_a_request_its_own_target_keeps_out_does_not_block_the_queue_behind_it():
    s, _ = make(num_blocks=256, budget=512, max_seqs=32, tpot_min_batch=1)
    for i in range(4):
        s.add_request(req(s, f"x{i}", 4, max_tokens=50, start=10 + 10 * i, tenant="x"))
    step(s)
    # first in line, but its own target (2 decodes at most) keeps it out while 4 run ...
    s.add_request(req(s, "tight", 4, max_tokens=50, start=300, tpot_s=0.03, tenant="a"))
    s.add_request(req(s, "later", 4, max_tokens=50, start=400, tenant="b"))
    plan, _ = step(s)
    assert "later" in plan and "tight" not in plan  # ... and what comes after it still starts


def test_a_tenants_tight_target_does_not_cut_anothers_prefill():
    s, _ = make(num_blocks=256, budget=512, max_seqs=32, min_prefill_chunk=16, tpot_min_batch=8)
    s.add_request(req(s, "a", 4, max_tokens=60, tpot_s=0.001, tenant="a"))
    step(s)
    s.add_request(req(s, "long", 200, max_tokens=4, start=300, tenant="b"))
    s.add_request(req(s, "a-long", 200, max_tokens=4, start=600, tenant="a"))
    plan, _ = step(s)
    assert plan["long"] == 200  # the whole prompt, not min_prefill_chunk tokens
    assert "a-long" not in plan  # a's own prefill waits under a's target (the step is past it already)


def test_the_policy_bounds_capacity_between_the_guaranteed_batch_and_max_num_seqs():
    p = TpotPolicy(min_batch=4, min_tpot_s=0.0, max_num_seqs=16)
    cost = fixed_cost()
    assert p.floor(cost) == pytest.approx(0.05)
    assert p.capacity(cost, 0.001) == 4 and p.capacity(cost, 0.2) == 16 and p.capacity(cost, float("inf")) == 16
    assert p.effective(None, cost) is None and p.effective(0.01, cost) == pytest.approx(0.05)
    with pytest.raises(ValueError):
        SchedulerConfig(tpot_min_batch=0)
    with pytest.raises(ValueError):
        SchedulerConfig(min_tpot_s=-1.0)
