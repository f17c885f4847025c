"""Gateway routing: prefill by prefix affinity against load, decode by power of two choices."""

import random

import pytest

from cloud_tier.gateway.workers.placement import (
    NoWorkerError,
    PrefixIndex,
    RouterConfig,
    WorkerLoad,
    choose_decode,
    choose_prefill,
    fits_ever,
    percentile,
)

BS = 4


def w(worker_id, pending=0, healthy=True):
    return WorkerLoad(worker_id, pending_prefill_tokens=pending, healthy=healthy)


def kv(worker_id, used, total=100, queue_len=0, healthy=True):
    return WorkerLoad(worker_id, kv_blocks_total=total, kv_blocks_used=used, queue_len=queue_len,
                      healthy=healthy)


# --- choose_prefill ---------------------------------------------------------------------------

PREFILL_CASES = [
    pytest.param([w("a", 100), w("b", 0)], {"a": 1024}, RouterConfig(),
                 ("a", 1024, 924.0, "prefix"), id="prefix-hit-outweighs-small-queue"),
    pytest.param([w("a", 4000), w("b", 0), w("c", 0)], {"a": 8192}, RouterConfig(),
                 ("b", 0, 0.0, "load"), id="overloaded-holder-loses-affinity-to-idle-worker"),
    pytest.param([w("a", 1000), w("b", 1000), w("c", 1000)], {"b": 512}, RouterConfig(),
                 ("b", 512, -488.0, "prefix"), id="uniformly-busy-workers-keep-affinity"),
    pytest.param([w("a", 400), w("b", 0)], {"a": 64}, RouterConfig(),
                 ("b", 0, 0.0, "load"), id="small-hit-does-not-beat-big-load-difference"),
    pytest.param([w("a", 100), w("b", 0)], {"a": 100}, RouterConfig(),
                 ("b", 0, 0.0, "load"), id="score-tie-goes-to-fewer-pending-tokens"),
    pytest.param([w("b", 0), w("a", 0)], {}, RouterConfig(),
                 ("a", 0, 0.0, "load"), id="full-tie-goes-to-lower-worker-id"),
    pytest.param([w("a", 0, healthy=False), w("b", 50)], {"a": 4096}, RouterConfig(),
                 ("b", 0, -50.0, "only"), id="unhealthy-holder-dropped"),
    pytest.param([w("a", 5000)], {"a": 64}, RouterConfig(),
                 ("a", 64, -4936.0, "only"), id="single-worker-is-never-overloaded"),
    pytest.param([w("a", 100), w("b", 0)], {"a": 1024}, RouterConfig(alpha=0.0),
                 ("b", 0, 0.0, "load"), id="alpha-zero-routes-on-load-only"),
    pytest.param([w("a", 100), w("b", 0)], {"a": 150}, RouterConfig(beta=0.5),
                 ("a", 150, 100.0, "prefix"), id="beta-scales-the-penalty"),
    pytest.param([w("a", 10), w("b", 0)], {"a": 100}, RouterConfig(prefill_ms_per_token=2.0),
                 ("a", 100, 180.0, "prefix"), id="scores-in-milliseconds"),
    pytest.param([w("a", 0), w("b", 0)], {"gone": 4096}, RouterConfig(),
                 ("a", 0, 0.0, "load"), id="hit-on-unknown-worker-ignored"),
]


@pytest.mark.parametrize("workers,hits,config,expected", PREFILL_CASES)
def test_choose_prefill(workers, hits, config, expected):
    c = choose_prefill(workers, hits, config)
    assert (c.worker_id, c.hit_tokens, c.score, c.reason) == expected


@pytest.mark.parametrize("workers", [
    pytest.param([], id="no-workers"),
    pytest.param([w("a", healthy=False), w("b", healthy=False)], id="all-unhealthy"),
])
def test_choose_prefill_without_healthy_worker_raises(workers):
    with pytest.raises(NoWorkerError):
        choose_prefill(workers, {}, RouterConfig())
    assert issubclass(NoWorkerError, LookupError)


@pytest.mark.parametrize("values,pct,expected", [
    ([5], 75, 5.0),
    ([0, 100], 75, 75.0),
    ([4000, 0, 0], 75, 2000.0),
    ([1, 2, 3, 4, 5], 50, 3.0),
    ([3, 1, 2], 100, 3.0),
    ([3, 1, 2], 0, 1.0),
])
def test_percentile_interpolates_linearly(values, pct, expected):
    assert percentile(values, pct) == expected


@pytest.mark.parametrize("kwargs", [
    {"overload_percentile": 101}, {"block_size": 0}, {"alpha": -1}, {"overload_min_tokens": -1},
])
def test_router_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        RouterConfig(**kwargs)


# --- PrefixIndex ------------------------------------------------------------------------------

def test_prompt_sharing_a_long_prefix_matches_its_holder_in_tokens():
    index = PrefixIndex(BS)
    system = list(range(100, 112))  # three blocks
    index.insert("a", system + [1, 2, 3, 4, 5])
    index.insert("a", system + [6, 7, 8, 9])
    index.insert("b", list(range(500, 520)))
    assert index.match(system + [6, 7, 8, 9, 10, 11]) == {"a": 16}
    assert index.match(system + [42, 42, 42, 42]) == {"a": 12}


@pytest.mark.parametrize("inserted,query,expected", [
    pytest.param(range(10), range(10), {"a": 8}, id="trailing-partial-block-not-indexed"),
    pytest.param(range(8), range(3), {}, id="query-shorter-than-a-block"),
    pytest.param(range(8), [*range(4), 9, 9, 9], {"a": 4}, id="partial-query-block-ignored"),
    pytest.param(range(8), [9, 9, 9, 9, 4, 5, 6, 7], {}, id="chained-hashes-need-equal-first-block"),
    pytest.param(range(8), [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11], {"a": 4}, id="stops-at-first-miss"),
])
def test_prefix_match_counts_leading_full_blocks(inserted, query, expected):
    index = PrefixIndex(BS)
    index.insert("a", list(inserted))
    assert index.match(list(query)) == expected


def test_block_hashes_cover_full_blocks_only_and_are_chained():
    index = PrefixIndex(BS)
    hashes = index.block_hashes(list(range(11)))
    assert len(hashes) == 2
    assert index.block_hashes([9, 9, 9, 9, 4, 5, 6, 7])[1] != hashes[1]
    assert index.block_hashes(list(range(8))) == hashes


def test_match_reports_every_worker_with_its_own_depth():
    index = PrefixIndex(BS)
    index.insert("a", list(range(12)))
    index.insert("b", list(range(4)))
    assert index.match(list(range(16))) == {"a": 12, "b": 4}


def test_lru_bound_evicts_the_oldest_leaf_first():
    index = PrefixIndex(BS, max_blocks_per_worker=3)
    index.insert("a", list(range(8)))
    index.insert("a", list(range(100, 108)))
    assert index.num_blocks("a") == 3
    assert index.match(list(range(8))) == {"a": 4}  # its first block outlived its second
    assert index.match(list(range(100, 108))) == {"a": 8}


def test_match_touches_entries_so_they_outlive_untouched_ones():
    index = PrefixIndex(BS, max_blocks_per_worker=4)
    index.insert("a", list(range(8)))
    index.insert("a", list(range(100, 108)))
    index.match(list(range(8)))
    index.insert("a", list(range(200, 208)))
    assert index.match(list(range(100, 108))) == {}
    assert index.match(list(range(8))) == {"a": 8}


def test_prompt_longer_than_the_bound_keeps_its_prefix():
    index = PrefixIndex(BS, max_blocks_per_worker=2)
    index.insert("a", list(range(16)))
    assert index.match(list(range(16))) == {"a": 8}


def test_removed_worker_no_longer_matches():
    index = PrefixIndex(BS)
    index.insert("a", list(range(8)))
    index.insert("b", list(range(8)))
    index.remove_worker("a")
    index.remove_worker("never-seen")
    assert index.match(list(range(8))) == {"b": 8}
    assert index.num_blocks("a") == 0


# --- choose_decode / fits_ever ----------------------------------------------------------------

DECODE_CASES = [
    pytest.param([kv("a", 95), kv("b", 99)], 10, 0.9, None, id="nothing-fits-under-watermark"),
    pytest.param([kv("a", 85), kv("b", 10)], 10, 0.9, "b", id="only-one-fits"),
    pytest.param([kv("a", 80), kv("b", 85)], 10, 0.9, "a", id="fits-exactly-at-watermark"),
    pytest.param([kv("a", 19), kv("b", 20)], 10, 0.29, "a", id="watermark-immune-to-float-error"),
    pytest.param([kv("a", 50), kv("b", 20)], 10, 0.9, "b", id="freer-of-two-wins"),
    pytest.param([kv("a", 10, total=200), kv("b", 10)], 10, 0.9, "a", id="free-blocks-not-ratio"),
    pytest.param([kv("a", 20, queue_len=3), kv("b", 20, queue_len=1)], 10, 0.9, "b",
                 id="free-tie-goes-to-shorter-queue"),
    pytest.param([kv("b", 20), kv("a", 20)], 10, 0.9, "a", id="full-tie-goes-to-lower-id"),
    pytest.param([kv("a", 0, healthy=False), kv("b", 60)], 10, 0.9, "b", id="unhealthy-excluded"),
    pytest.param([], 1, 0.9, None, id="no-workers"),
]


@pytest.mark.parametrize("workers,need,watermark,expected", DECODE_CASES)
def test_choose_decode(workers, need, watermark, expected):
    chosen = choose_decode(workers, need, watermark, random.Random(0))
    assert (chosen.worker_id if chosen else None) == expected


def test_choose_decode_picks_the_freer_of_the_two_sampled_with_the_given_rng():
    workers = [kv(f"w{i}", used) for i, used in enumerate([70, 10, 40, 55, 25, 5])]
    for seed in range(20):
        a, b = random.Random(seed).sample(workers, 2)
        expected = a if a.kv_blocks_free > b.kv_blocks_free else b
        assert choose_decode(workers, 5, 0.9, random.Random(seed)) == expected


def test_choose_decode_never_picks_the_fullest_fitting_worker():
    workers = [kv("a", 10), kv("b", 30), kv("c", 60)]
    rng = random.Random(1)
    picks = {choose_decode(workers, 5, 0.9, rng).worker_id for _ in range(200)}
    assert picks == {"a", "b"}


@pytest.mark.parametrize("workers,need,watermark,expected", [
    pytest.param([kv("a", 99, total=100)], 90, 0.9, True, id="full-now-but-fits-when-empty"),
    pytest.param([kv("a", 0, total=100)], 91, 0.9, False, id="larger-than-watermark"),
    pytest.param([kv("a", 0, total=100)], 29, 0.29, True, id="exactly-the-watermark"),
    pytest.param([kv("a", 0, total=1000, healthy=False), kv("b", 0)], 200, 0.9, False,
                 id="only-unhealthy-worker-is-big-enough"),
    pytest.param([], 1, 0.9, False, id="no-workers"),
])
def test_fits_ever(workers, need, watermark, expected):
    assert fits_ever(workers, need, watermark) is expected


# --- scenario ---------------------------------------------------------------------------------

def test_shared_prefix_workload_lands_on_the_prefix_holder_unless_it_is_overloaded():
    config = RouterConfig()
    index = PrefixIndex(config.block_size, config.index_blocks_per_worker)
    system = list(range(1000, 2024))  # a 1024-token shared system prompt
    prompts = [system + [i] * 40 for i in range(7)]
    pending = {"w0": 0, "w1": 0, "w2": 0}

    def route(prompt):
        loads = [WorkerLoad(wid, pending_prefill_tokens=p) for wid, p in pending.items()]
        choice = choose_prefill(loads, index.match(prompt), config)
        index.insert(choice.worker_id, prompt)
        return choice

    cold = route(prompts[0])
    assert (cold.worker_id, cold.reason, cold.hit_tokens) == ("w0", "load", 0)

    pending["w0"] = 300  # a few suffixes in flight: cheaper than recomputing the prefix
    for prompt in prompts[1:4]:
        c = route(prompt)
        assert (c.worker_id, c.reason, c.hit_tokens) == ("w0", "prefix", 1024)

    pending["w0"] = 3000  # a burst queued on the holder: it is overloaded, affinity dropped
    spilled = route(prompts[4])
    assert (spilled.worker_id, spilled.reason) == ("w1", "load")

    follow = route(prompts[5])  # w1 now holds the prefix too and wins on affinity
    assert (follow.worker_id, follow.reason, follow.hit_tokens) == ("w1", "prefix", 1024)

    pending["w0"] = 0  # the burst drained: both holders are equal, lower id wins
    back = route(prompts[6])
    assert (back.worker_id, back.reason) == ("w0", "prefix")
