"""The scheduler's service levels as tables: class and slack order, early refusals, deadlines, the
short-prompt lane, TPOT-bound admission and tenants' reservations. No torch; a fake clock and a
fixed step-cost model (learning it is tested on its own)."""

import math

import pytest

from cloud_tier.engine.kv_cache_manager import KVCacheManager
from cloud_tier.engine.request import Request, RequestStatus, ServiceLevel
from cloud_tier.engine.scheduler import Scheduler
from cloud_tier.engine.scheduling.admission import SLOMissError
from cloud_tier.engine.scheduling.step_cost import StepCostModel, estimate_ttft
from cloud_tier.engine.scheduling.tenants import Reservations
from cloud_tier.engine_config import SchedulerConfig
from cloud_tier.sampling import SamplingParams

EOS = 2


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def fixed_cost(base=0.01, per_token=0.001, per_decode=0.01, per_seq=0.0):
    """A cost model that does not learn (decay 1, a prior too heavy to move)."""
    return StepCostModel(base, per_token, per_decode, decay=1.0, prior_weight=1e12, per_prefill_seq_s=per_seq)


def make(num_blocks=64, block_size=4, budget=64, max_seqs=8, cost=None, **kw):
    clock = Clock()
    kv = KVCacheManager(num_blocks, block_size, True, "test")
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=1024, **kw)
    return Scheduler(cfg, kv, clock, cost or fixed_cost()), clock


def req(s, rid, n_prompt, max_tokens=4, start=10, **slo):
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=frozenset({EOS}), arrival_time=s.clock(), slo=ServiceLevel(**slo))


def step(s):
    out = s.schedule()
    sampled = {x.request.request_id: 7 for x in out.scheduled if x.samples}
    s.update(out, sampled)
    s.kv.check_integrity()
    return {x.request.request_id: x.num_new_tokens for x in out.scheduled}, out


def test_classes_then_slack_order_the_queue():
    s, _ = make(max_seqs=1)
    for r in (req(s, "batch", 4, priority_class="batch"), req(s, "loose", 4, ttft_s=30.0),
              req(s, "tight", 4, ttft_s=2.0), req(s, "escalation", 4, priority_class="escalation", ttft_s=1.0)):
        s.add_request(r)
    assert [r.request_id for r in s.waiting] == ["tight", "loose", "escalation", "batch"]


def test_batch_is_preempted_first_even_when_it_came_first():
    s, _ = make(num_blocks=8, block_size=4, budget=64)  # 32 tokens: room for one of them at a time
    s.add_request(req(s, "batch", 6, max_tokens=20, priority_class="batch"))
    step(s)
    s.add_request(req(s, "online", 6, max_tokens=20, start=100))
    while not s.num_preemptions:
        plan, _ = step(s)
    assert s.requests["batch"].status == RequestStatus.PREEMPTED and "online" in plan


def run_out(s, steps=200):
    for _ in range(steps):
        if not s.has_unfinished():
            return
        step(s)
    raise AssertionError("requests still unfinished")


def test_an_online_request_takes_the_slot_of_a_running_batch_request_at_once():
    s, clock = make(num_blocks=64, max_seqs=2)
    for i in range(2):
        s.add_request(req(s, f"batch{i}", 6, max_tokens=30, start=10 + 10 * i, priority_class="batch"))
        clock.now += 1
    step(s)
    step(s)
    s.add_request(req(s, "online", 6, max_tokens=4, start=100))
    plan, out = step(s)
    assert "online" in plan and out.preempted == ["batch1"]  # the later of the two gave way
    assert s.requests["batch1"].status == RequestStatus.PREEMPTED and "batch1" not in plan
    run_out(s)
    assert s.num_preemptions == 1  # and it resumed and finished (run_out), once the slot was free


def test_an_escalation_takes_the_kv_of_a_running_batch_request_and_a_batch_request_never_an_online_ones():
    # 10 blocks of 4 tokens: the batch request holds 6 of them; the escalation needs 5
    s, _ = make(num_blocks=10, block_size=4, budget=64, max_seqs=8)
    s.add_request(req(s, "batch", 20, max_tokens=3, priority_class="batch"))
    step(s)
    s.add_request(req(s, "esc", 18, max_tokens=2, start=100, priority_class="escalation"))
    plan, out = step(s)
    assert plan == {"esc": 18} and out.preempted == ["batch"]
    run_out(s)
    s.add_request(req(s, "online", 20, max_tokens=3, start=200))
    step(s)
    s.add_request(req(s, "batch2", 18, max_tokens=2, start=300, priority_class="batch"))
    plan, out = step(s)
    assert "batch2" not in plan and not out.preempted  # a lower class waits: it takes nobody's place
    run_out(s)


def test_a_request_whose_fresh_blocks_another_hit_this_step_gives_way_only_in_the_next():
    s, clock = make(num_blocks=64, block_size=4, budget=16, max_seqs=2)
    s.add_request(req(s, "v", 20, max_tokens=8, priority_class="batch"))
    plan, _ = step(s)
    assert plan == {"v": 16}
    clock.now += 1
    s.add_request(req(s, "h", 24, max_tokens=4))  # v's 20 tokens, then 4 of its own
    clock.now += 1
    s.add_request(req(s, "w", 6, max_tokens=4, start=500))
    plan, out = step(s)
    # h hit v's block 4, which v fills in this very step: preempting v now would leave it unwritten
    assert plan == {"v": 4, "h": 4} and s.requests["h"].num_cached_tokens == 20 and not out.preempted
    plan, out = step(s)
    assert "w" in plan and out.preempted == ["v"]  # a step later v's blocks are written: it gives way
    run_out(s)


def test_the_same_class_waits_for_a_slot_instead_of_preempting():
    s, _ = make(num_blocks=64, max_seqs=1)
    s.add_request(req(s, "first", 6, max_tokens=10))
    step(s)
    s.add_request(req(s, "second", 6, max_tokens=4, start=100))
    plan, out = step(s)
    assert plan == {"first": 1} and not out.preempted and s.num_waiting == 1


def test_under_overload_what_would_miss_its_ttft_target_is_refused_at_once_and_nothing_is_queued():
    # 10 ms a prompt token: each 40-token prompt takes ~0.41 s to prefill; all have a 1 s target
    s, _ = make(num_blocks=256, budget=64, cost=fixed_cost(base=0.01, per_token=0.01), slo_headroom=0.0)
    s.add_request(req(s, "r0", 40, ttft_s=1.0))
    s.add_request(req(s, "r1", 40, ttft_s=1.0, start=100))
    with pytest.raises(SLOMissError) as e:
        s.add_request(req(s, "r2", 40, ttft_s=1.0, start=200))
    assert e.value.retry_after_s >= 1.0 and "r2" not in s.requests
    assert [r.request_id for r in s.waiting] == ["r0", "r1"] and s.num_rejected[""] == 1
    s.add_request(req(s, "patient", 40, ttft_s=10.0, start=300))  # it can wait: admitted
    s.add_request(req(s, "untargeted", 40, start=400))  # no target: never refused


def promising(budget):
    """10 ms a prompt token, no decode cost, promises up to the whole target (no headroom)."""
    return make(num_blocks=256, budget=budget, cost=fixed_cost(base=0.01, per_token=0.01, per_decode=0.0),
                slo_headroom=0.0)


def test_a_newcomer_goes_ahead_only_of_those_whose_first_token_can_wait_for_it():
    # 10 ms a prompt token, no decode cost: "a" and "b" expect their first tokens at ~0.41 and ~0.82 s.
    # "x" (100 tokens) has the least slack but would push "b" (0.35 s of it) ~1 s back: it queues
    # behind "b" instead, where it still makes its own target. "y" could only go first or break
    # a promise: it is refused, though its own prefill alone would fit.
    s, clock = promising(budget=64)
    s.add_request(req(s, "a", 40, ttft_s=1.0))
    s.add_request(req(s, "b", 40, ttft_s=1.35, start=100))
    s.add_request(req(s, "x", 100, ttft_s=1.9, start=200))
    assert [r.request_id for r in s.waiting] == ["a", "b", "x"]
    with pytest.raises(SLOMissError):
        s.add_request(req(s, "y", 40, ttft_s=1.0, start=400))
    first_token = {}
    while s.has_unfinished():
        _, out = step(s)
        clock.now += s.cost.step_s(out.num_prefill_tokens, out.num_decodes, out.num_prefill_seqs)
        for r in (x.request for x in out.scheduled):
            if r.num_output_tokens and r.request_id not in first_token:
                first_token[r.request_id] = clock.now - r.arrival_time
    targets = {"a": 1.0, "b": 1.35, "x": 1.9}
    assert first_token.keys() == targets.keys() and all(first_token[k] <= targets[k] for k in targets), first_token


def test_an_admission_leaves_headroom_for_the_way_to_the_client():
    # ~0.41 s of prefill against a 0.44 s target: within it, not within 75% of it
    s, _ = make(num_blocks=256, budget=64, cost=fixed_cost(base=0.01, per_token=0.01))
    with pytest.raises(SLOMissError, match="too close to its time-to-first-token target of 0.44 s"):
        s.add_request(req(s, "tight", 40, ttft_s=0.44))
    s.add_request(req(s, "fits", 40, ttft_s=0.55))
    relaxed, _ = make(num_blocks=256, budget=64, cost=fixed_cost(base=0.01, per_token=0.01), slo_headroom=0.0)
    relaxed.add_request(req(relaxed, "tight", 40, ttft_s=0.44))
    with pytest.raises(ValueError, match="slo_headroom"):
        SchedulerConfig(slo_headroom=1.0)


def test_a_step_that_runs_over_its_estimate_moves_the_promises_and_what_would_now_miss_is_refused():
    # "a" runs; "b" (~0.82 s expected, 1.0 s target) and "c" (~0.82 + 0.41, 3.0 s) wait. The step
    # takes 0.5 s over its estimate (the server parsing a burst on the same cores): "b" would now
    # miss, so it is refused before it starts, not once its target has passed; "c" can still make it.
    s, clock = promising(budget=40)
    s.add_request(req(s, "a", 40, ttft_s=1.0))
    s.add_request(req(s, "b", 40, ttft_s=1.0, start=100))
    s.add_request(req(s, "c", 40, ttft_s=3.0, start=200))
    _, out = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    late = s.cost.step_s(out.num_prefill_tokens, out.num_decodes, out.num_prefill_seqs) + 0.5
    s.observe_step(out, late)
    clock.now += late
    ran, out = step(s)
    assert [r.request_id for r in out.rejected] == ["b"] and clock.now - 1000.0 < 1.0  # before its target
    assert "c" in ran and out.rejected[0].status == RequestStatus.FINISHED_ABORTED


def test_a_short_request_is_not_refused_for_a_long_prefill_it_runs_beside():
    s, _ = make(num_blocks=256, budget=64, cost=fixed_cost(base=0.01, per_token=0.01))
    s.add_request(req(s, "long", 400))
    step(s)
    s.add_request(req(s, "short", 8, ttft_s=1.0, start=500))  # the short lane: not behind the long prefill


def test_a_tight_target_goes_ahead_of_an_untargeted_queue_instead_of_being_refused():
    s, _ = make(num_blocks=256, budget=64, cost=fixed_cost(base=0.01, per_token=0.01))
    s.add_request(req(s, "long", 400))
    s.add_request(req(s, "urgent", 8, ttft_s=1.0, start=500))  # due before the long one: not behind it
    assert s.waiting[0].request_id == "urgent"


def test_a_queued_request_whose_target_passes_before_it_starts_is_refused():
    s, clock = make(max_seqs=1, cost=fixed_cost(base=0.001, per_token=0.0001, per_decode=0.001))
    s.add_request(req(s, "running", 4, max_tokens=50))
    step(s)
    s.add_request(req(s, "queued", 4, ttft_s=0.5, start=100))
    clock.now += 1.0
    _, out = step(s)
    assert out.rejected == [s_req for s_req in out.rejected if s_req.request_id == "queued"] and out.rejected
    assert out.rejected[0].status == RequestStatus.FINISHED_ABORTED and "queued" not in s.requests


def test_a_deadline_ends_a_request_with_what_it_has():
    s, clock = make()
    r = req(s, "a", 4, max_tokens=100, deadline=clock.now + 5)
    queued = req(s, "b", 4, max_tokens=100, start=50, deadline=clock.now + 5)
    s.add_request(r)
    for _ in range(3):
        step(s)
    s.add_request(queued)
    clock.now += 5
    plan, out = step(s)
    assert set(out.expired) == {r, queued} and not plan
    assert r.status == RequestStatus.FINISHED_LENGTH and r.truncated == "deadline" and r.num_output_tokens == 3
    assert queued.num_output_tokens == 0 and s.kv.num_free_blocks == s.kv.num_blocks


def test_a_short_prompt_is_not_stuck_behind_a_long_prefill():
    s, _ = make(num_blocks=256, budget=64, short_prompt_tokens=32, short_lane_share=0.25)
    s.add_request(req(s, "long", 600))
    plan, _ = step(s)
    assert plan == {"long": 64}
    s.add_request(req(s, "short", 10, start=900))
    plan, _ = step(s)
    assert plan == {"long": 48, "short": 10}  # the long lane keeps 3/4 of the step while a short one waits
    plan, _ = step(s)
    assert plan["long"] == 63 and plan["short"] == 1  # the short one decodes; the long one goes on


def test_a_short_prompt_passes_a_waiting_long_one_whose_lane_is_spent():
    s, _ = make(num_blocks=256, budget=64, short_prompt_tokens=32, short_lane_share=0.25)
    s.add_request(req(s, "long1", 300))
    s.add_request(req(s, "long2", 300, start=400))
    s.add_request(req(s, "short", 10, start=900))
    plan, _ = step(s)
    assert plan == {"long1": 48, "short": 10}


def test_the_tpot_target_caps_the_prefill_a_step_takes_next_to_decodes():
    # a step: 10 ms + 1 ms per prefill token + 10 ms per decode; TPOT target 100 ms, 4 decodes running
    s, _ = make(num_blocks=256, budget=512, min_prefill_chunk=16)
    for i in range(4):
        s.add_request(req(s, f"d{i}", 4, max_tokens=50, start=10 + 10 * i, tpot_s=0.1))
    step(s)
    s.add_request(req(s, "long", 400, start=300))
    plan, _ = step(s)
    assert plan["long"] == 50  # (0.1 - 0.01 - 4 * 0.01) / 0.001


def test_under_a_tpot_target_each_prefill_chunk_is_charged_its_own_cost_as_well():
    # a step: 10 ms + 1 ms per prefill token + 20 ms per prompt chunk + 10 ms per decode; TPOT 100 ms
    s, _ = make(num_blocks=256, budget=512, max_seqs=32, cost=fixed_cost(per_seq=0.02))
    for i in range(2):
        s.add_request(req(s, f"d{i}", 4, max_tokens=50, start=10 + 10 * i, tpot_s=0.1))
    step(s)
    for i in range(10):
        s.add_request(req(s, f"p{i}", 10, max_tokens=50, start=100 + 20 * i, tpot_s=0.1))
    plan, out = step(s)
    # 100 - 10 - 2 x 10 = 70 ms for prefill: two prompts of 10 tokens (30 ms each), not seven (70 tokens)
    assert sorted(plan) == ["d0", "d1", "p0", "p1"]
    assert s.cost.step_s(out.num_prefill_tokens, out.num_decodes, out.num_prefill_seqs) <= 0.1


def test_the_first_chunk_of_a_step_under_a_tpot_target_still_progresses():
    s, _ = make(num_blocks=256, budget=512, max_seqs=32, min_prefill_chunk=8, cost=fixed_cost(per_seq=0.2))
    s.add_request(req(s, "d", 4, max_tokens=50, tpot_s=0.1))
    step(s)
    s.add_request(req(s, "p", 40, max_tokens=4, start=100, tpot_s=0.1))
    plan, _ = step(s)
    assert plan == {"d": 1, "p": 8}  # no time is left for any chunk: min_prefill_chunk tokens of one


def test_the_tpot_target_bounds_how_many_decode_at_once():
    # decodes_within(0.05) = (0.05 - 0.01) / 0.01 = 4 (with no guaranteed batch: test_slo_tenants.py has the floor)
    s, _ = make(num_blocks=256, budget=512, max_seqs=32, tpot_min_batch=1)
    for i in range(6):
        s.add_request(req(s, f"r{i}", 4, max_tokens=50, start=10 + 10 * i, tpot_s=0.05))
    plan, _ = step(s)
    assert len(plan) == 4 and s.num_waiting == 2


def test_a_reservation_holds_under_another_tenants_flood():
    # 32 blocks of 4 tokens; gold keeps half of them and half the slots
    s, _ = make(num_blocks=32, block_size=4, budget=512, max_seqs=8, reservations="gold=0.5")
    for i in range(12):
        s.add_request(req(s, f"flood{i}", 12, max_tokens=20, start=10 + 20 * i, tenant="flood"))
    for _ in range(30):
        step(s)
        blocks, slots = s.pools.usage()
        assert blocks[""] <= 16 and slots[""] <= 4
    assert s.num_waiting > 0  # the flood is still queued ...
    s.add_request(req(s, "gold", 12, max_tokens=4, start=1000, tenant="gold"))
    plan, _ = step(s)
    assert "gold" in plan  # ... and gold starts at once, not behind it


def test_without_a_reservation_in_use_the_flood_still_gets_only_the_unreserved_share():
    s, _ = make(num_blocks=32, block_size=4, budget=512, max_seqs=8, reservations="gold=0.25")
    for i in range(8):
        s.add_request(req(s, f"flood{i}", 12, max_tokens=40, start=10 + 20 * i, tenant="flood"))
    for _ in range(60):
        step(s)
        assert s.pools.usage()[0][""] <= 24
    assert s.num_preemptions > 0  # its growth preempted its own, never took gold's blocks


def test_reservations_parse_and_refuse_bad_shares():
    assert Reservations.parse("gold=0.3, silver=0.1").shares == {"gold": 0.3, "silver": 0.1}
    for bad in ("gold", "gold=1.5", "=0.2", "a=0.6,b=0.5", "gold=x"):
        with pytest.raises(ValueError):
            Reservations.parse(bad)


def test_the_step_cost_model_learns_a_linear_machine():
    m = StepCostModel()
    truth = (0.005, 0.0002, 0.003)
    for i in range(400):
        p, d = (i * 37) % 300, (i * 11) % 40
        m.observe(p, d, truth[0] + truth[1] * p + truth[2] * d)
    assert m.base_s == pytest.approx(truth[0], rel=0.05)
    assert m.per_prefill_token_s == pytest.approx(truth[1], rel=0.05)
    assert m.per_decode_s == pytest.approx(truth[2], rel=0.05)
    m.observe(10, 1, math.nan)  # a bad measurement changes nothing
    assert m.per_decode_s == pytest.approx(truth[2], rel=0.05)


def test_estimate_ttft_counts_the_prefill_steps_and_the_slot_wait():
    m = fixed_cost(base=0.01, per_token=0.001, per_decode=0.01)
    assert estimate_ttft(m, 0, 100, 64, 0) == pytest.approx(2 * 0.01 + 0.1)
    assert estimate_ttft(m, 0, 10, 64, 2, slot_wait_steps=5) == pytest.approx(5 * 0.03 + 0.03 + 0.01)


def test_estimate_ttft_under_a_tpot_target_takes_shorter_steps():
    m = fixed_cost(base=0.01, per_token=0.001, per_decode=0.01, per_seq=0.005)
    # 100 tokens and 4 prompts: 0.1 + 0.02 s of prefill work; steps of at most 0.05 s beside 1 decode
    # leave 0.03 s each: 4 steps of 0.02 s of base and decode, not the one the token budget allows
    assert estimate_ttft(m, 60, 40, 512, 1, prompts_ahead=3) == pytest.approx(0.02 + 0.12)
    assert estimate_ttft(m, 60, 40, 512, 1, prompts_ahead=3, step_cap_s=0.05) == pytest.approx(4 * 0.02 + 0.12)
