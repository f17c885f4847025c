"""Scheduler fuzz: random arrivals, priority classes and priorities (with ties), prompt lengths, max_tokens, stop
tokens, aborts, prefills held for a transfer, duplicate ids and tiny KV budgets, hand-driven
step by step as in test_scheduler.py; the same cases again with preemption by swap (a random swap
space) and a second KV tier, whose moves are played as the engine plays them. After every step the
KV cache is intact and the step is sound; at the end every request has finished, been aborted or
been refused at the door, and every block is free. Fixed seeds: the same cases on every run."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

import pytest

from cloud_tier.engine.kv_cache_manager import KVCacheManager
from cloud_tier.engine.request import Request, RequestStatus, ServiceLevel
from cloud_tier.engine.scheduler import Scheduler
from cloud_tier.engine.scheduling.output import SchedulerOutput
from cloud_tier.engine.swap import SwapSpace
from cloud_tier.engine_config import SchedulerConfig
from cloud_tier.sampling import SamplingParams

EOS = 2
TOKENS = (2, 10, 11, 12)  # a tiny vocabulary, so prompts share prefixes and EOS comes up
STEPS = 300
SEEDS = range(24)


@dataclass
class Tally:
    admitted: list[Request] = field(default_factory=list)
    aborted: set[int] = field(default_factory=set)  # id() of the request records aborted
    refused: int = 0
    duplicates_refused: int = 0
    swap: object = None  # SwapStats and TierStats at the end
    tier: object = None


def make_scheduler(rng: random.Random, tier_blocks: int = 0, swap: SwapSpace | None = None) -> Scheduler:
    max_len = rng.randint(4, 48)
    chunked = rng.random() < 0.8
    budget = rng.randint(1, 24) if chunked else rng.randint(max_len, max_len + 16)
    cfg = SchedulerConfig(max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=budget, max_model_len=max_len,
                          enable_chunked_prefill=chunked, long_prefill_token_threshold=rng.choice((0, 0, 3)))
    return Scheduler(cfg, KVCacheManager(rng.randint(1, 12), rng.choice((1, 2, 4, 8)), rng.random() < 0.8, "fuzz",
                                         tier_blocks=tier_blocks), swap=swap)


def new_request(rng: random.Random, s: Scheduler, n: int, now: float) -> Request:
    in_flight = [*s.requests, *s.held]
    rid = rng.choice(in_flight) if in_flight and rng.random() < 0.15 else f"r{n}"
    prompt = [rng.choice(TOKENS[1:]) for _ in range(rng.randint(1, s.config.max_model_len + 2))]
    params = SamplingParams(max_tokens=rng.randint(1, 40), stop_token_ids=(12,) if rng.random() < 0.2 else (),
                            ignore_eos=rng.random() < 0.3)
    # (priority, arrival) ties are common: they are where a preemption victim may already be scheduled
    # classes too: a waiting higher class takes a lower one's slot and KV (WaitingPass._yield_to)
    req = Request(rid, prompt, params, eos_token_ids=frozenset({EOS}), priority=rng.choice((-1, 0, 0, 0, 0, 1)),
                  arrival_time=rng.choice((now, float(int(now) // 8), float(int(now) // 8))),
                  slo=ServiceLevel(rng.choice(("interactive", "interactive", "escalation", "batch"))))
    req.kv_transfer = rng.random() < 0.1
    return req


def admit(s: Scheduler, req: Request, tally: Tally) -> None:
    duplicate = req.request_id in s.requests or req.request_id in s.held
    # the KV it can hold at once: all but its last token, sampled and never computed
    last = req.num_tokens if req.kv_transfer else min(req.num_tokens + req.sampling_params.max_tokens,
                                                      s.config.max_model_len) - 1
    fits = req.num_tokens < s.config.max_model_len and last <= s.kv.num_blocks * s.kv.block_size
    try:
        s.add_request(req)
    except ValueError:
        assert duplicate or not fits, f"refused a request that could run: {req}"
        tally.refused += 1
        tally.duplicates_refused += duplicate
        return
    assert not duplicate and fits, f"admitted a request that must be refused: {req}"
    tally.admitted.append(req)


def check_step(s: Scheduler, out: SchedulerOutput) -> None:
    bs = s.kv.block_size
    ids = [x.request.request_id for x in out.scheduled]
    assert len(ids) == len(set(ids)), f"a request scheduled twice: {ids}"
    assert out.num_batched_tokens <= s.config.max_num_batched_tokens
    assert len(s.running) <= s.config.max_num_seqs
    for x in out.scheduled:
        r = x.request
        assert r.status == RequestStatus.RUNNING and r in s.running, f"scheduled but {r.status.name}: {r}"
        assert x.num_new_tokens >= 1 and x.start + x.num_new_tokens <= r.num_tokens
        assert len(x.block_ids) * bs >= x.start + x.num_new_tokens, f"{r.request_id} has no room for its tokens"
        assert x.block_ids == s.kv.get_block_ids(r.request_id)
    for r in s.waiting:
        swapped = s.swap.is_swapped(r.request_id)
        assert (r.num_computed_tokens == 0 or swapped) and not s.kv.get_block_ids(r.request_id), f"waiting with KV: {r}"
    for x in out.swap_out:  # the blocks of its computed tokens
        r = s.requests[x.request_id]
        assert len(x.block_ids) == s.kv.blocks_for_tokens(r.num_computed_tokens) == s.swap.num_blocks(r.request_id)
    scheduled = {x.request.request_id: x for x in out.scheduled}
    for x in out.swap_in:  # the first of its new blocks, as many as it swapped out
        assert list(x.block_ids) == scheduled[x.request_id].block_ids[:s.swap.num_blocks(x.request_id)]


def play_moves(s: Scheduler, out: SchedulerOutput) -> None:
    """What the engine's KVMover does before the forward, with the request id as the payload."""
    evicted, _ = s.kv.take_tier_moves()
    for e in evicted:
        s.kv.tier.insert(e.block_hash, e.parent_hash, e.token_ids)
    for x in out.swap_out:
        s.swap.put(x.request_id, x.request_id)
    for x in out.swap_in:
        assert s.swap.take(x.request_id) == x.request_id


def step(rng: random.Random, s: Scheduler) -> None:
    out = s.schedule()
    check_step(s, out)
    play_moves(s, out)
    sampled = {x.request.request_id: rng.choice(TOKENS) for x in out.scheduled if x.samples}
    s.update(out, sampled)
    s.kv.check_integrity()


@functools.cache  # each seed runs once per session, however many tests look at it
def run_case(seed: int, moves: bool = False) -> Tally:
    rng = random.Random(seed)
    # with moves, a swap space of 0 to 12 blocks of one byte: some victims fit, some do not
    swap = SwapSpace("swap", budget_bytes=random.Random(-seed).randint(0, 12), bytes_per_block=1) if moves else None
    s = make_scheduler(rng, tier_blocks=random.Random(-seed).randint(1, 16) if moves else 0, swap=swap)
    tally = Tally()
    n = 0
    for t in range(STEPS):
        for _ in range(rng.choice((0, 0, 0, 1, 1, 2))):
            admit(s, new_request(rng, s, n, float(t)), tally)
            n += 1
        live = [*s.requests.values()]
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            assert s.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED) == [victim]
            tally.aborted.add(id(victim))
        if s.held and rng.random() < 0.3:
            s.release(rng.choice(list(s.held)))
        step(rng, s)
    for rid in list(s.held):  # the transfers end; then everything still in flight must drain
        s.release(rid)
    for _ in range(40 * STEPS):
        if not s.has_unfinished():
            break
        step(rng, s)
        for rid in list(s.held):
            s.release(rid)
    assert not s.has_unfinished(), f"seed {seed}: stalled with {s.waiting} waiting, {s.running} running"
    for r in tally.admitted:
        assert r.is_finished, f"seed {seed}: {r} never finished"
        if id(r) not in tally.aborted and r.status != RequestStatus.FINISHED_TRANSFERRED:
            assert 1 <= r.num_output_tokens <= r.sampling_params.max_tokens
            assert r.num_tokens <= s.config.max_model_len
        if r.status == RequestStatus.FINISHED_TRANSFERRED:
            assert r.num_output_tokens == 1
    looked_up = [r for r in tally.admitted if r.num_cached_tokens >= 0]  # admitted into a step at least once
    assert s.kv.stats.queries == sum(r.num_prompt_tokens for r in looked_up)  # once each, however long it waited
    assert s.kv.stats.hits == sum(r.num_cached_tokens for r in looked_up)
    assert not s.requests and not s.held and s.kv.num_free_blocks == s.kv.num_blocks
    assert not s.swap.reserved and not s.swap.payloads
    s.kv.check_integrity()
    tally.swap = s.swap.stats
    tally.tier = s.kv.tier.stats if s.kv.tier is not None else None
    return tally


@pytest.mark.parametrize("moves", [False, True], ids=["recompute", "swap+tier"])
@pytest.mark.parametrize("seed", SEEDS)
def test_scheduler_fuzz(seed, moves):
    tally = run_case(seed, moves)
    assert tally.admitted  # every case runs something


def test_the_fuzz_reaches_what_it_is_for():
    """Across the seeds: preemptions, refusals, refused duplicates, aborts and held prefills."""
    tallies = [run_case(seed) for seed in SEEDS]
    assert sum(t.refused for t in tallies) > 0 and sum(t.duplicates_refused for t in tallies) > 0
    assert sum(len(t.aborted) for t in tallies) > 0
    assert any(r.num_preemptions for t in tallies for r in t.admitted)
    assert any(r.status == RequestStatus.FINISHED_TRANSFERRED for t in tallies for r in t.admitted)
    moved = [run_case(seed, True) for seed in SEEDS]
    assert sum(t.swap.by_swap for t in moved) > 0 and sum(t.swap.by_recompute for t in moved) > 0
    assert sum(t.tier.hits for t in moved if t.tier) > 0
