"""The second KV tier: its index (slots, LRU, verification) and how the KV cache manager records
evictions into it and continues a prefix hit chain from it; no model."""

from cloud_tier.engine.kv_cache_manager import KVCacheManager, TierLoad
from cloud_tier.engine.kv_tier import TierIndex
from cloud_tier.engine.request import Request
from cloud_tier.sampling import SamplingParams

BS = 4


def test_index_fills_slots_then_reuses_the_least_recently_used():
    t = TierIndex(2)
    assert t.insert(1, 0, (1,)) == 0 and t.insert(2, 1, (2,)) == 1
    t.touch(1)  # 2 is now the least recently used
    assert t.insert(3, 2, (3,)) == 1
    assert t.lookup(2, 1, (2,)) is None and t.lookup(1, 0, (1,)) == 0 and t.lookup(3, 2, (3,)) == 1
    t.check_integrity()


def test_index_insert_of_a_held_block_only_refreshes_it():
    t = TierIndex(2)
    t.insert(1, 0, (1,))
    t.insert(2, 1, (2,))
    assert t.insert(1, 0, (1,)) is None  # already there: nothing to write
    assert t.insert(3, 2, (3,)) == 1  # 2 was the least recently used


def test_index_hit_needs_the_same_parent_and_tokens():
    t = TierIndex(4)
    t.insert(7, 5, (1, 2))
    assert t.lookup(7, 5, (1, 2)) == 0
    assert t.lookup(7, 6, (1, 2)) is None and t.lookup(7, 5, (1, 3)) is None


def make_request(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4))


def prefill(m, req):
    computed, hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - hit, computed)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    m.check_integrity()
    return computed, hit, new


def save_all(m):
    """What the engine does before a step: put the evicted blocks into the tier index."""
    evicted, loads = m.take_tier_moves()
    for e in evicted:
        m.tier.insert(e.block_hash, e.parent_hash, e.token_ids)
    return evicted, loads


def test_evicted_cached_blocks_are_recorded_for_the_tier_and_the_chain_continues_there():
    m = KVCacheManager(3, BS, True, "m@1", tier_blocks=8)
    a = make_request("a", range(9))  # 2 full blocks + 1 token: blocks 0, 1, 2
    prefill(m, a)
    m.free(a)  # free queue: 2, 1, 0 (tail first); 0 and 1 cached
    b = make_request("b", range(100, 109))
    prefill(m, b)  # takes 2, 1, 0: the two cached ones are evicted
    evicted, loads = save_all(m)
    assert sorted(e.block_id for e in evicted) == [0, 1] and not loads
    m.free(b)
    again = make_request("a2", range(9))
    computed, hit = m.get_computed_blocks(again)
    assert hit == 8 and not computed.blocks and len(computed.tier_hashes) == 2
    new = m.allocate_slots(again, 1, computed)
    _, loads = m.take_tier_moves()
    assert loads == [TierLoad(new.blocks[0].block_id, m.tier.entries[computed.tier_hashes[0]].slot),
                     TierLoad(new.blocks[1].block_id, m.tier.entries[computed.tier_hashes[1]].slot)]
    assert m.tier.stats.hits == 2 and m.tier.stats.misses == 4  # a and b found nothing anywhere
    m.check_integrity()


def test_pool_hits_come_first_and_the_tier_continues_the_chain():
    m = KVCacheManager(5, BS, True, "m@1", tier_blocks=8)
    a = make_request("a", range(13))  # 3 full blocks + 1: blocks 0..3
    prefill(m, a)
    m.free(a)  # free queue 4, 3, 2, 1, 0
    b = make_request("b", range(100, 110))  # takes 4, 3 and 2: evicts a's third block (2)
    prefill(m, b)
    (e,) = save_all(m)[0]
    assert e.block_id == 2
    m.free(b)
    c = make_request("c", range(13))
    computed, hit = m.get_computed_blocks(c)
    assert computed.get_block_ids() == [0, 1] and len(computed.tier_hashes) == 1 and hit == 12
    m.allocate_slots(c, 1, computed)
    assert len(m.take_tier_moves()[1]) == 1
    m.check_integrity()


def test_no_tier_no_records_and_uncached_blocks_never_go_to_the_tier():
    m = KVCacheManager(3, BS, True, "m@1")
    a = make_request("a", range(9))
    prefill(m, a)
    m.free(a)
    prefill(m, make_request("b", range(100, 109)))
    assert m.take_tier_moves() == ([], [])
    t = KVCacheManager(3, BS, True, "m@1", tier_blocks=4)
    a = make_request("a", range(9))
    prefill(t, a)
    t.discard(a)  # KV never written: out of the prefix cache, and so never saved
    prefill(t, make_request("b", range(100, 109)))
    assert t.take_tier_moves() == ([], [])


def test_reset_prefix_cache_empties_the_tier():
    m = KVCacheManager(3, BS, True, "m@1", tier_blocks=4)
    m.tier.insert(1, 0, (1, 2, 3, 4))
    m.reset_prefix_cache()
    assert not m.tier.entries
