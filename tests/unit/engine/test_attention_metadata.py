"""AttentionMetadata.build over a whole batch against the per-request definition: each new
token's cache slot, its position, the decode groups and the prefill chunks' context slots."""

import torch

from cloud_tier.engine.attention import AttentionMetadata

BLOCK = 4
# (tokens computed before, new tokens, block table): decodes at block edges, a fresh prefill,
# a chunk continuing a prefill, a decode after it
CHUNKS = [(5, 1, [7, 2]), (0, 6, [3, 9]), (3, 1, [4]), (8, 5, [1, 5, 8, 6]), (11, 1, [10, 11, 12])]


def slot(table, pos):
    return table[pos // BLOCK] * BLOCK + pos % BLOCK


def test_slots_positions_and_groups_follow_each_request():
    meta = AttentionMetadata.build(CHUNKS, BLOCK, {None}, torch.device("cpu"), native=object(), native_prefill_max=0)
    rows = [(start + i, table) for start, n, table in CHUNKS for i in range(n)]
    assert meta.positions.tolist() == [pos for pos, _ in rows]
    assert meta.slot_mapping.tolist() == [slot(table, pos) for pos, table in rows]
    [group] = meta.decodes  # the native kernel takes every decode at once
    assert torch.arange(len(rows))[group.rows].tolist() == [0, 7, 13]
    assert group.lens.tolist() == [6, 4, 12]
    assert group.tables[:, :2].tolist() == [[7, 2], [4, 0], [10, 11]]
    assert [(p.start, p.query_len, p.context_len) for p in meta.prefills] == [(1, 6, 6), (8, 5, 13)]
    assert meta.prefills[1].slots.tolist() == [slot([1, 5, 8, 6], pos) for pos in range(13)]
    assert meta.prefills[0].masks[None] is None and meta.prefills[1].masks[None].shape == (5, 13)


def test_torch_path_buckets_mask_each_decode_to_its_own_length_and_window():
    meta = AttentionMetadata.build(CHUNKS, BLOCK, {None, 3}, torch.device("cpu"))
    for group in meta.decodes:
        for b, length in enumerate(group.lens.tolist()):
            full = group.masks[None][b, 0, 0]
            assert full.tolist() == [k < length for k in range(full.shape[0])]
            assert group.masks[3][b, 0, 0].nonzero().flatten().tolist() == list(range(max(0, length - 3), length))
    assert sorted(r for g in meta.decodes for r in torch.arange(14)[g.rows].tolist()) == [0, 7, 13]


def test_the_native_kernel_takes_short_prefill_chunks_each_row_up_to_its_own_position():
    meta = AttentionMetadata.build(CHUNKS, BLOCK, {None}, torch.device("cpu"), native=object(), native_prefill_max=6)
    [group] = meta.decodes
    # the fresh 6-token prompt's rows join the decodes around it, in batch order
    assert torch.arange(14)[group.rows].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 13]
    assert group.lens.tolist() == [6, 1, 2, 3, 4, 5, 6, 4, 12]
    assert group.tables[1:7, :2].tolist() == [[3, 9]] * 6
    assert [(p.start, p.query_len, p.context_len) for p in meta.prefills] == [(8, 5, 13)]  # 13 > 6: SDPA
    everything = AttentionMetadata.build(CHUNKS, BLOCK, {None}, torch.device("cpu"), native=object(),
                                         native_prefill_max=100)
    assert everything.prefills == [] and everything.decodes[0].rows == slice(0, 14)
    assert everything.decodes[0].lens.tolist() == [6, 1, 2, 3, 4, 5, 6, 4, 9, 10, 11, 12, 13, 12]
