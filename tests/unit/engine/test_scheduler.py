"""Scheduler decisions from small hand-built cases; no torch."""

import dataclasses

import pytest

from cloud_tier.engine.kv_cache_manager import KVCacheManager
from cloud_tier.engine.request import Request, RequestStatus
from cloud_tier.engine.scheduler import Scheduler
from cloud_tier.engine_config import SchedulerConfig
from cloud_tier.sampling import SamplingParams

EOS = 2


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, chunked=True, caching=True, max_len=256):
    kv = KVCacheManager(num_blocks, block_size, caching, "test")
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                          enable_chunked_prefill=chunked)
    return Scheduler(cfg, kv)


def req(rid, n_prompt, max_tokens=4, priority=0, arrival=0.0, start=10, **kw):
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens, **kw),
                   eos_token_ids=frozenset({EOS}), priority=priority, arrival_time=arrival)


def step(s, tokens=None):
    """One step where every sampling request gets token 7 (or what ``tokens`` says)."""
    out = s.schedule()
    sampled = {x.request.request_id: (tokens or {}).get(x.request.request_id, 7) for x in out.scheduled if x.samples}
    plan = [(x.request.request_id, x.num_new_tokens) for x in out.scheduled]
    finished = s.update(out, sampled)
    s.kv.check_integrity()
    return plan, out, finished


def test_prefill_then_decode_until_max_tokens():
    s = make()
    r = req("a", 6, max_tokens=3)
    s.add_request(r)
    assert step(s)[0] == [("a", 6)]
    assert step(s)[0] == [("a", 1)]
    plan, _, finished = step(s)
    assert plan == [("a", 1)] and finished == [r]
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [7, 7, 7]
    assert s.kv.num_free_blocks == 64 and not s.has_unfinished()


def test_eos_and_stop_token_ids_stop():
    s = make()
    a, b = req("a", 3, max_tokens=10), req("b", 3, max_tokens=10, stop_token_ids=(9,))
    s.add_request(a)
    s.add_request(b)
    step(s)
    _, _, finished = step(s, {"a": EOS, "b": 9})
    assert set(finished) == {a, b} and a.status == b.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_keeps_going():
    s = make()
    a = req("a", 3, max_tokens=3, ignore_eos=True)
    s.add_request(a)
    step(s, {"a": EOS})
    step(s, {"a": EOS})
    assert not a.is_finished
    step(s, {"a": EOS})
    assert a.status == RequestStatus.FINISHED_LENGTH


def test_long_prompt_is_chunked_and_running_decodes_go_first():
    s = make(budget=8)
    s.add_request(req("short", 3, max_tokens=10))
    assert step(s)[0] == [("short", 3)]
    s.add_request(req("long", 20, arrival=1.0))
    assert step(s)[0] == [("short", 1), ("long", 7)]
    assert step(s)[0] == [("short", 1), ("long", 7)]
    plan, out, _ = step(s)
    assert plan == [("short", 1), ("long", 6)]
    assert s.requests["long"].num_output_tokens == 1  # sampled once its last chunk ran


def test_prompt_chunk_does_not_sample():
    s = make(budget=8)
    s.add_request(req("long", 12))
    out = s.schedule()
    assert [(x.num_new_tokens, x.samples) for x in out.scheduled] == [(8, False)]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = make(budget=256, chunked=False)
    s.add_request(req("a", 10, max_tokens=50))
    step(s)
    s.add_request(req("b", 200, arrival=1.0, start=500))
    assert step(s)[0] == [("a", 1), ("b", 200)]


def test_token_budget_and_max_num_seqs_bound_a_step():
    s = make(budget=10, max_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, arrival=float(i)))
    assert step(s)[0] == [("r0", 4), ("r1", 4)]
    assert s.num_waiting == 1


def test_priority_then_arrival_order():
    s = make(budget=4)
    s.add_request(req("late-urgent", 4, priority=-1, arrival=5.0))
    s.add_request(req("early", 4, arrival=1.0))
    s.add_request(req("late", 4, arrival=2.0))
    assert [r.request_id for r in s.waiting] == ["late-urgent", "early", "late"]
    assert step(s)[0] == [("late-urgent", 4)]


def test_preemption_recomputes_the_lowest_priority_request():
    s = make(num_blocks=4, block_size=4, budget=64)
    a, b = req("a", 7, max_tokens=9, arrival=0.0), req("b", 7, max_tokens=9, arrival=1.0, start=100)
    s.add_request(a)
    s.add_request(b)
    step(s)  # a: blocks 0,1 ; b: blocks 2,3 ; no block free
    plan, out, _ = step(s)  # both fill their 2nd block (8 tokens), still fits
    assert plan == [("a", 1), ("b", 1)]
    plan, out, _ = step(s)  # a needs a 3rd block: b (later arrival) is preempted
    assert out.preempted == ["b"] and plan == [("a", 1)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting[0] is b and b.num_output_tokens == 2  # its tokens are kept, recomputed later
    assert s.num_preemptions == 1


def test_preempted_request_resumes_and_finishes():
    s = make(num_blocks=6, block_size=4, budget=64)
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8, arrival=1.0, start=100)
    s.add_request(a)
    s.add_request(b)
    for _ in range(40):
        if not s.has_unfinished():
            break
        step(s)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert s.num_preemptions >= 1
    assert s.kv.num_free_blocks == 6


def test_waiting_request_that_does_not_fit_blocks_the_line():
    s = make(num_blocks=4, block_size=4, budget=64)
    s.add_request(req("big", 12, max_tokens=1))
    s.add_request(req("small", 2, arrival=1.0, start=200))
    s.add_request(req("next", 2, arrival=2.0, start=300))
    plan, _, _ = step(s)
    assert plan == [("big", 12), ("small", 2)]
    assert [r.request_id for r in s.waiting] == ["next"]


def test_prefix_cache_hit_is_counted_and_skips_computation():
    s = make(budget=64)
    s.add_request(req("a", 9, max_tokens=1))
    step(s)
    b = req("b", 11, max_tokens=1, arrival=1.0)  # same first 8 tokens (range(10, 21))
    s.add_request(b)
    plan, _, _ = step(s)
    assert plan == [("b", 3)] and b.num_cached_tokens == 8


def test_abort_frees_blocks_from_waiting_or_running():
    s = make()
    s.add_request(req("a", 5, max_tokens=10))
    step(s)
    s.add_request(req("b", 5, arrival=1.0))
    done = s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["a", "b"]
    assert s.kv.num_free_blocks == 64 and not s.has_unfinished()


def test_requests_that_can_never_fit_are_refused_at_the_door():
    s = make(num_blocks=2, block_size=4, max_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(req("a", 64))
    with pytest.raises(ValueError, match="KV cache"):
        s.add_request(req("b", 8))


def run_until_idle(s, max_steps=200):
    for _ in range(max_steps):
        if not s.has_unfinished():
            return
        step(s)
    raise AssertionError("the scheduler did not drain")


def test_request_whose_output_can_never_fit_is_refused_at_the_door():
    s = make(num_blocks=4, block_size=4, max_len=256)  # the whole cache holds 16 tokens
    with pytest.raises(ValueError, match=r"19 tokens.*16 tokens"):
        s.add_request(req("big", 4, max_tokens=16))  # its peak: 4 + 16 - 1 = 19 tokens of KV
    assert not s.has_unfinished() and s.kv.num_free_blocks == 4
    fits = req("fits", 4, max_tokens=13, start=100)  # 4 + 13 - 1 = 16 tokens: exactly the cache
    s.add_request(fits)
    run_until_idle(s)
    assert fits.status == RequestStatus.FINISHED_LENGTH and fits.num_output_tokens == 13


def test_max_model_len_bounds_the_peak_a_request_can_need():
    s = make(num_blocks=4, block_size=4, max_len=17)  # stops at 17 tokens: 16 computed at most
    r = req("a", 4, max_tokens=1000)
    s.add_request(r)
    run_until_idle(s)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 17


def test_small_request_behind_a_refused_one_runs():
    s = make(num_blocks=4, block_size=4, max_len=256)
    with pytest.raises(ValueError):
        s.add_request(req("big", 8, max_tokens=20))
    small = req("small", 3, max_tokens=2, arrival=1.0, start=100)
    s.add_request(small)
    run_until_idle(s)
    assert small.status == RequestStatus.FINISHED_LENGTH


def held_prefill(s, rid="p", n=6):
    r = req(rid, n, max_tokens=8)
    r.kv_transfer = True
    s.add_request(r)
    step(s)
    assert s.held[rid] is r
    return r


def test_duplicate_id_of_a_held_prefill_is_refused_and_its_blocks_untouched():
    s = make()
    held = held_prefill(s)
    blocks = s.kv.get_block_ids("p")
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(req("p", 6, start=100))
    adopted = req("p", 6, start=200)
    adopted.append_token(7)
    with pytest.raises(ValueError, match="duplicate"):
        s.adopt(adopted)
    assert not s.has_unfinished() and s.held["p"] is held and s.kv.get_block_ids("p") == blocks
    s.release("p")
    assert s.kv.num_free_blocks == 64


def test_duplicate_id_of_a_running_request_is_refused():
    s = make()
    first = req("a", 4, max_tokens=3)
    s.add_request(first)
    step(s)
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(req("a", 4, start=100))
    run_until_idle(s)
    assert first.status == RequestStatus.FINISHED_LENGTH and first.output_token_ids == [7, 7, 7]


def test_preempting_a_request_scheduled_this_step_takes_it_out_and_returns_its_budget():
    s = make(num_blocks=4, block_size=4, budget=16)
    a, b, c = req("a", 3), req("b", 8, start=100), req("c", 2, start=200)  # one (priority, arrival)
    for r in (a, b, c):
        s.add_request(r)
    assert step(s)[0] == [("a", 3), ("b", 8), ("c", 2)]  # blocks: a 1, b 2, c 1: none free
    s.config = dataclasses.replace(s.config, max_num_batched_tokens=2)
    plan, out, _ = step(s)  # a fits its block; b needs a 3rd: the tie makes a, already scheduled, the victim
    assert out.preempted == ["a"] and plan == [("b", 1), ("c", 1)]
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0 and a.num_output_tokens == 1
    s.config = dataclasses.replace(s.config, max_num_batched_tokens=16)
    run_until_idle(s)
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [7] * 4 for r in (a, b, c))
    assert s.kv.num_free_blocks == 4


def test_prefix_cache_queries_count_a_request_once_however_long_it_waits():
    s = make(num_blocks=4, block_size=4, budget=64)
    big = req("big", 12, max_tokens=4)
    s.add_request(big)
    waiter = req("waiter", 6, max_tokens=1, arrival=1.0, start=100)
    s.add_request(waiter)
    steps = 0
    while waiter.status == RequestStatus.WAITING:
        step(s)
        steps += 1
    assert steps > 2  # it was looked at, and refused room, several times
    run_until_idle(s)
    assert s.kv.stats.queries == 12 + 6 and s.kv.stats.hits == 0
    assert waiter.num_cached_tokens == 0
