"""The sliding-window layers' own KV group: blocks that left the window are freed as the request
goes on, the table keeps its length (freed entries read as the null block), and a request needs
room in both groups; no model."""

import pytest

from cloud_tier.engine.kv_cache_manager import KVCacheManager
from cloud_tier.engine.request import Request
from cloud_tier.engine.window_kv import NULL_BLOCK, WindowBlocks, window_group
from cloud_tier.engine_config import EngineConfig
from cloud_tier.sampling import SamplingParams

BS = 4


def make(num_blocks=16, num_window_blocks=4, window=8):
    return KVCacheManager(num_blocks, BS, False, "m@1", window=WindowBlocks(num_window_blocks, BS, window))


def advance(m, req, n):
    assert m.allocate_slots(req, n) is not None
    req.num_computed_tokens += n
    m.check_integrity()


@pytest.mark.parametrize("computed, first", [(0, 0), (7, 0), (8, 0), (11, 1), (12, 1), (15, 2), (40, 8)])
def test_first_needed_block(computed, first):
    """A query at p reads p-7 .. p (window 8): from ``computed`` on, blocks before ``first`` are unread."""
    assert WindowBlocks(4, BS, 8).first_needed_block(computed) == first


def test_blocks_that_left_the_window_are_freed_and_read_as_the_null_block():
    m = make()
    r = Request("r", list(range(12)), SamplingParams(max_tokens=40))
    advance(m, r, 12)  # window blocks 0, 1, 2
    assert m.get_window_block_ids("r") == [0, 1, 2] and m.get_block_ids("r") == [0, 1, 2]
    for _ in range(12):  # decode to 24 tokens: the window moves on
        r.append_token(5)
        advance(m, r, 1)
    table = m.get_window_block_ids("r")
    # the last step computed position 23, which reads 16..23: blocks 0-3 were freed before it
    assert len(table) == 6 and table[:4] == [NULL_BLOCK] * 4
    assert m.window.num_free_blocks == 4 - 2 and len(m.get_block_ids("r")) == 6  # global layers keep all six
    m.free(r)
    assert m.window.num_free_blocks == 4 and m.num_free_blocks == 16
    m.check_integrity()


def test_a_request_needs_room_in_both_groups():
    m = make(num_window_blocks=3)
    a = Request("a", list(range(12)), SamplingParams(max_tokens=4))
    advance(m, a, 12)  # all 3 window blocks
    b = Request("b", list(range(100, 104)), SamplingParams(max_tokens=4))
    assert m.allocate_slots(b, 4) is None  # the global group has room, the window group none
    assert m.num_free_blocks == 13 and not m.get_block_ids("b")
    m.check_integrity()


def test_max_blocks_per_request_covers_the_worst_alignment():
    w = WindowBlocks(64, BS, 8)
    worst = 0
    for computed in range(0, 40):
        for chunk in range(1, 6):
            live = (computed + chunk - 1) // BS - w.first_needed_block(computed) + 1
            worst = max(worst, live)
    assert worst <= w.max_blocks_per_request(5)


def test_prefix_caching_is_refused_with_a_window_group():
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(8, BS, True, "m@1", window=WindowBlocks(4, BS, 8))


def test_window_group_splits_the_block_bytes_by_layer_kind_and_checks_one_request_fits():
    layers = [8, 8, None, 8, 8, None]  # 4 local layers, 2 global; 600 bytes a block over all six
    cfg = EngineConfig(block_size=BS, max_num_batched_tokens=5, enable_prefix_caching=False, kv_window_blocks=6)
    window, per_block, window_bytes = window_group(cfg, layers, 600)  # one request: up to 4 window blocks
    assert window.window == 8 and window.pool.num_blocks == 6
    assert per_block == 200 and window_bytes == 6 * 400
    assert window_group(EngineConfig(), layers, 600) == (None, 600, 0)  # off
    assert window_group(cfg, [None, None], 600) == (None, 600, 0)  # no sliding layer: nothing to split
    with pytest.raises(ValueError, match="cannot hold one request"):
        window_group(EngineConfig(block_size=BS, max_num_batched_tokens=5, kv_window_blocks=3), layers, 600)
    with pytest.raises(ValueError, match="one sliding window"):
        window_group(cfg, [8, 16, None], 600)
