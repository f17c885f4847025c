"""KV cache manager: exact block ids, hits, eviction order (after vLLM's test_prefix_caching)."""

import pytest

from cloud_tier.engine.kv_cache_manager import KVCacheManager
from cloud_tier.engine.request import Request
from cloud_tier.sampling import SamplingParams

BS = 4


def make_request(rid, tokens, max_tokens=16):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def make_manager(num_blocks=10, caching=True, model="m@1"):
    return KVCacheManager(num_blocks, BS, caching, model)


def prefill(m, req):
    computed, hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - hit, computed)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    m.check_integrity()
    return computed, hit, new


def test_first_request_gets_blocks_from_the_head_of_the_free_queue():
    m = make_manager()
    req = make_request("a", range(10))  # 2 full blocks + 2 tokens
    computed, hit, new = prefill(m, req)
    assert hit == 0 and len(computed) == 0
    assert new.get_block_ids() == [0, 1, 2]
    assert len(m.pool.cached) == 2  # only full blocks are cached
    assert m.num_free_blocks == 7


def test_shared_prefix_hits_full_blocks_and_computes_only_the_rest():
    m = make_manager()
    a = make_request("a", range(10))
    prefill(m, a)
    b = make_request("b", [*range(8), 99, 98, 97])
    computed, hit, new = prefill(m, b)
    assert computed.get_block_ids() == [0, 1] and hit == 8
    assert new.get_block_ids() == [3]
    assert m.pool.blocks[0].ref_cnt == 2 and m.pool.blocks[1].ref_cnt == 2
    assert m.stats.queries == 0  # a lookup is not an admission: the scheduler records those


def test_at_least_one_token_is_left_to_compute():
    m = make_manager()
    prefill(m, make_request("a", range(8)))
    b = make_request("b", range(8))  # identical, exactly two blocks
    computed, hit = m.get_computed_blocks(b)
    assert hit == 4 and computed.get_block_ids() == [0]


def test_different_model_identity_never_reuses_kv():
    m1 = make_manager(model="smollm2@v1")
    prefill(m1, make_request("a", range(8)))
    m2 = make_manager(model="smollm2@v2")
    prefill(m2, make_request("a", range(8)))
    assert set(m1.pool.cached) .isdisjoint(m2.pool.cached)


def test_hash_hit_with_different_tokens_is_not_reused():
    m = make_manager()
    a = make_request("a", range(9))
    prefill(m, a)
    block = m.pool.blocks[0]
    block.token_ids = (7, 7, 7, 7)  # a forged collision: same hash, other tokens
    _, hit = m.get_computed_blocks(make_request("b", range(9)))
    assert hit == 0


def test_freed_blocks_are_evicted_tail_first_and_least_recent_first():
    m = make_manager(num_blocks=6)
    a = make_request("a", range(12))  # blocks 0,1,2
    prefill(m, a)
    m.free(a)
    # free queue: untouched 3,4,5 first, then a's blocks tail first: 2,1,0
    assert list(m.pool.free_queue) == [3, 4, 5, 2, 1, 0]
    b = make_request("b", range(100, 116))  # needs 4 blocks: 3,4,5 and then evicts 2
    _, hit, new = prefill(m, b)
    assert hit == 0 and new.get_block_ids() == [3, 4, 5, 2]
    assert m.pool.blocks[2].block_hash is not None  # now b's, re-hashed
    c = make_request("c", [*range(8), 50, 51, 52, 53, 54])  # a's first two blocks are still cached
    computed, hit = m.get_computed_blocks(c)
    assert hit == 8 and computed.get_block_ids() == [0, 1]
    m.check_integrity()


def test_cached_free_blocks_are_taken_back_from_the_free_queue_on_a_hit():
    m = make_manager(num_blocks=4)
    a = make_request("a", range(9))
    prefill(m, a)
    m.free(a)
    assert m.num_free_blocks == 4
    b = make_request("b", [*range(8), 5, 6])
    computed, hit, new = prefill(m, b)
    assert computed.get_block_ids() == [0, 1] and new.get_block_ids() == [3]
    assert m.num_free_blocks == 1


def test_allocation_that_does_not_fit_changes_nothing():
    m = make_manager(num_blocks=3)
    a = make_request("a", range(8))
    prefill(m, a)
    b = make_request("b", range(50, 62))
    computed, hit = m.get_computed_blocks(b)
    assert m.allocate_slots(b, 12, computed) is None
    assert m.num_free_blocks == 1 and "b" not in m.req_blocks
    m.check_integrity()


def test_free_hits_count_against_what_can_be_allocated():
    m = make_manager(num_blocks=3)
    a = make_request("a", range(8))
    prefill(m, a)
    m.free(a)  # 3 free, two of them cached
    b = make_request("b", [*range(8), *range(20, 29)])  # hits 2 (free) + needs 3 more = 5 > 3
    computed, hit = m.get_computed_blocks(b)
    assert hit == 8
    assert m.allocate_slots(b, 9, computed) is None
    m.check_integrity()


def test_decode_fills_a_block_and_caches_it():
    m = make_manager()
    a = make_request("a", range(7))
    prefill(m, a)
    a.append_token(42)  # sampled token 8 completes block 1
    assert m.allocate_slots(a, 1).get_block_ids() == []
    assert len(m.pool.cached) == 2
    a.num_computed_tokens += 1
    a.append_token(43)
    assert m.allocate_slots(a, 1).get_block_ids() == [2]
    m.check_integrity()


def test_without_prefix_caching_nothing_is_shared():
    m = make_manager(caching=False)
    prefill(m, make_request("a", range(8)))
    _, hit, new = prefill(m, make_request("b", range(8)))
    assert hit == 0 and new.get_block_ids() == [2, 3]
    assert not m.pool.cached


def test_integrity_check_catches_a_leaked_reference():
    m = make_manager()
    prefill(m, make_request("a", range(8)))
    m.pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError):
        m.check_integrity()


def test_discarded_blocks_leave_the_prefix_cache_unless_another_request_holds_them():
    m = make_manager()
    a = make_request("a", range(9))  # blocks 0, 1 cached
    prefill(m, a)
    b = make_request("b", [*range(8), *range(50, 59)])  # hits 0, 1; caches its own 3, 4
    _, hit, _ = prefill(m, b)
    assert hit == 8
    m.discard(b)  # b's step failed: its own blocks may hold nothing
    m.check_integrity()
    assert m.get_computed_blocks(make_request("c", [*range(8), *range(50, 59)]))[1] == 8  # a's, still good
    m.discard(a)
    assert not m.pool.cached and m.num_free_blocks == 10
    m.check_integrity()
