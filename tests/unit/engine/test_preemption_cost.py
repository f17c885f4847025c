"""Preemption by cost: the swap-or-recompute choice from a table, the swap space's accounting,
and the scheduler's swap-outs and swap-ins from small hand-built cases; no model."""

import pytest

from cloud_tier.engine.kv_cache_manager import KVCacheManager
from cloud_tier.engine.request import Request, RequestStatus
from cloud_tier.engine.scheduler import Scheduler
from cloud_tier.engine.swap import SwapIn, SwapOut, SwapSpace, choose_preemption
from cloud_tier.engine_config import SchedulerConfig
from cloud_tier.sampling import SamplingParams

MB = 1 << 20


@pytest.mark.parametrize("mode, nbytes, free, s_per_byte, tokens, s_per_token, expected", [
    ("auto", 10 * MB, 1 << 30, 1e-9, 500, 1e-3, "swap"),  # 10 ms of copies vs 500 ms of prefill
    ("auto", 10 * MB, 1 << 30, 1e-7, 5, 1e-3, "recompute"),  # 1 s of copies vs 5 ms of prefill
    ("auto", 10 * MB, 5 * MB, 1e-9, 500, 1e-3, "recompute"),  # does not fit the swap space
    ("auto", 10 * MB, 1 << 30, None, 500, 1e-3, "recompute"),  # copy cost not measured
    ("auto", 10 * MB, 1 << 30, 1e-9, 500, None, "recompute"),  # no prefill seen yet
    ("swap", 10 * MB, 1 << 30, 1e-7, 5, 1e-3, "swap"),  # forced, even where it costs more
    ("swap", 10 * MB, 5 * MB, 1e-9, 500, 1e-3, "recompute"),  # forced, but no room
    ("swap", 0, 1 << 30, None, 0, None, "recompute"),  # nothing computed: nothing to swap
    ("recompute", 10 * MB, 1 << 30, 1e-9, 500, 1e-3, "recompute"),
])
def test_choice_table(mode, nbytes, free, s_per_byte, tokens, s_per_token, expected):
    assert choose_preemption(mode, nbytes, free, s_per_byte, tokens, s_per_token) == expected


def test_swap_space_reserves_until_taken_or_dropped():
    space = SwapSpace("swap", budget_bytes=300, bytes_per_block=100)
    assert space.choose("a", 2, 8) == "swap" and space.used_bytes == 200
    assert space.choose("b", 2, 8) == "recompute"  # 200 more do not fit in the 100 left
    space.put("a", "payload-a")
    assert space.is_swapped("a") and space.num_blocks("a") == 2
    assert space.take("a") == "payload-a" and space.used_bytes == 0 and not space.is_swapped("a")
    assert space.choose("c", 3, 12) == "swap"
    space.put("c", "payload-c")
    space.drop("c")
    assert space.used_bytes == 0 and not space.payloads
    st = space.stats
    assert (st.by_swap, st.by_recompute, st.swapped_out_bytes, st.swapped_in_bytes) == (2, 1, 500, 200)


def test_prefill_estimate_is_an_ema():
    space = SwapSpace("auto", smoothing=0.5)
    space.observe_prefill(1.0, 1000)
    assert space.prefill_s_per_token == pytest.approx(1e-3)
    space.observe_prefill(3.0, 1000)
    assert space.prefill_s_per_token == pytest.approx(2e-3)
    space.observe_prefill(1.0, 0)  # a step with no tokens says nothing
    assert space.prefill_s_per_token == pytest.approx(2e-3)


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="preemption_mode"):
        SwapSpace("sometimes")


def make(mode, num_blocks=4, budget_bytes=1 << 20):
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
                  KVCacheManager(num_blocks, 4, True, "test"), swap=SwapSpace(mode, budget_bytes, bytes_per_block=10))
    return s


def req(rid, n_prompt, arrival, start):
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=9), arrival_time=arrival)


def step(s):
    out = s.schedule()
    s.update(out, {x.request.request_id: 7 for x in out.scheduled if x.samples})
    s.kv.check_integrity()
    return out


def preempt_b(mode, **kw):
    """a and b fill the 4 blocks; a's third block preempts b (as the scheduler tests do)."""
    s = make(mode, **kw)
    a, b = req("a", 7, 0.0, 10), req("b", 7, 1.0, 100)
    s.add_request(a)
    s.add_request(b)
    step(s)
    step(s)
    b_blocks = s.kv.get_block_ids("b")
    out = step(s)
    assert out.preempted == ["b"] and b.status == RequestStatus.PREEMPTED
    return s, a, b, b_blocks, out


def test_a_swapped_request_keeps_its_computed_tokens_and_lists_its_blocks_to_copy_out():
    s, a, b, b_blocks, out = preempt_b("swap")
    assert b.num_computed_tokens == 8 and out.swap_out == [SwapOut("b", tuple(b_blocks))]
    assert s.swap.is_swapped("b") and s.swap.stats.by_swap == 1
    assert not out.swap_in


def test_a_swapped_request_resumes_with_new_blocks_listed_to_copy_in():
    s, a, b, _, _ = preempt_b("swap")
    s.swap.put("b", "kv of b")
    while True:
        out = step(s)
        if out.swap_in:
            break
    (sched,) = [x for x in out.scheduled if x.request is b]
    assert out.swap_in == [SwapIn("b", tuple(sched.block_ids[:2]))]
    assert sched.num_new_tokens == 1  # it goes on from its 8 swapped tokens: nothing is recomputed
    assert s.swap.take("b") == "kv of b"
    while s.has_unfinished():
        step(s)
    assert a.num_output_tokens == b.num_output_tokens == 9 and s.kv.num_free_blocks == 4


@pytest.mark.parametrize("mode, kw", [("recompute", {}), ("swap", {"budget_bytes": 10})])
def test_recompute_drops_the_computed_tokens(mode, kw):
    s, _, b, _, out = preempt_b(mode, **kw)
    assert b.num_computed_tokens == 0 and not out.swap_out and s.swap.stats.by_recompute == 1


def test_blocks_allocated_for_a_step_the_victim_misses_leave_the_prefix_cache():
    """A victim already scheduled this step (a priority tie) had blocks hashed for KV that will
    never be written: freed, no later prompt may hit them."""
    kv = KVCacheManager(4, 4, True, "test")
    r = req("r", 6, 0.0, 10)
    kv.allocate_slots(r, 6)  # a step would fill block 0 and part of block 1; it never runs
    assert len(kv.pool.cached) == 1
    kv.free_preempted(r)  # r.num_computed_tokens == 0: nothing it holds was written
    assert not kv.pool.cached
    kv.check_integrity()
