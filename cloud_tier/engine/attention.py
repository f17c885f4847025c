"""Paged attention: K/V live in fixed-size blocks; each request reads its own through its block
table. One function (``paged_attention``) is the whole op, so a fused kernel can replace it.

Per step the runner builds ``AttentionMetadata`` once; every layer then writes its new K/V into
the cache first and reads after, so a block filled earlier in the same step is visible (the
prefix cache relies on that). Decodes (one query token each) run as a few batched SDPAs over
gathered, padded contexts, bucketed by length; prefill chunks run one SDPA each with a causal mask offset by the
tokens already computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cloud_tier.engine.kv_quant import Int8KV


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flat batch
    query_len: int
    context_len: int  # tokens of the request in the cache after this step
    slots: torch.Tensor  # [context_len] flat cache slots of positions 0..context_len-1
    masks: dict[int | None, torch.Tensor | None]  # sliding window (None: full) -> bool mask or None (plain causal)


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [B] rows of the flat batch
    tables: torch.Tensor  # [B, max_blocks] block tables, padded with block 0
    lens: torch.Tensor  # [B] context lengths (the new token included)
    block_ids: torch.Tensor  # tables, flattened
    block_size: int
    masks: dict[int | None, torch.Tensor]  # sliding window -> [B, 1, 1, L] bool


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] where each new token's K/V is written
    decodes: list[DecodeGroup]  # decodes bucketed by context length, to pad less
    prefills: list[PrefillChunk]
    native: object | None = None  # the compiled CPU decode kernel, which reads blocks in place
    windowed: AttentionMetadata | None = None  # the sliding-window layers', when they have their own blocks

    @classmethod
    def build(cls, chunks: list[tuple[int, int, list[int]]], block_size: int, windows: set[int | None],
              device: torch.device, native: object | None = None) -> AttentionMetadata:
        """``chunks``: per request in batch order (num_computed_before, num_new, block_ids)."""
        slot_mapping, prefills, decode_rows, decode_tables, decode_lens = [], [], [], [], []
        row = 0
        for start, n, block_ids in chunks:
            table = torch.tensor(block_ids, dtype=torch.long)
            pos = torch.arange(start, start + n)
            slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
            ctx = start + n
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(block_ids)
                decode_lens.append(ctx)
            else:
                all_pos = torch.arange(ctx)
                slots = (table[all_pos // block_size] * block_size + all_pos % block_size).to(device)
                masks = {w: _prefill_mask(n, ctx, w, device) for w in windows}
                prefills.append(PrefillChunk(row, n, ctx, slots, masks))
            row += n
        groups = []
        buckets = [list(range(len(decode_lens)))] if native and decode_lens else _buckets(decode_lens)
        for bucket in buckets:
            groups.append(_decode_group([decode_rows[i] for i in bucket], [decode_tables[i] for i in bucket],
                                        [decode_lens[i] for i in bucket], block_size, windows, device))
        return cls(torch.cat(slot_mapping).to(device), groups, prefills, native)


def _prefill_mask(q_len: int, ctx: int, window: int | None, device) -> torch.Tensor | None:
    if ctx == q_len and (window is None or window >= ctx):
        return None  # plain causal attention over the chunk itself
    q_pos = torch.arange(ctx - q_len, ctx, device=device)[:, None]
    k_pos = torch.arange(ctx, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    return mask


def _buckets(lens: list[int], per_bucket: int = 16, max_buckets: int = 4) -> list[list[int]]:
    """Indices of ``lens`` split by length into a few buckets, so each padded decode batch
    wastes little on its shorter members."""
    if not lens:
        return []
    order = sorted(range(len(lens)), key=lens.__getitem__)
    n = min(max_buckets, -(-len(lens) // per_bucket))
    size = -(-len(order) // n)
    return [order[i:i + size] for i in range(0, len(order), size)]


def _decode_group(rows, tables, lens, block_size, windows, device) -> DecodeGroup:
    max_blocks = max(len(t) for t in tables)
    padded = torch.zeros(len(tables), max_blocks, dtype=torch.long)
    for i, t in enumerate(tables):
        padded[i, :len(t)] = torch.tensor(t, dtype=torch.long)
    lens_t = torch.tensor(lens)[:, None]
    k_pos = torch.arange(max_blocks * block_size)[None, :]
    masks = {}
    for w in windows:
        m = k_pos < lens_t
        if w is not None:
            m &= (lens_t - 1) - k_pos < w
        masks[w] = m[:, None, None, :].to(device)
    padded = padded.to(device)
    return DecodeGroup(torch.tensor(rows, device=device), padded, lens_t[:, 0].to(device), padded.flatten(),
                       block_size, masks)


KVCache = torch.Tensor | Int8KV  # one layer's K (or V): [slots, KVH, D] in the model dtype, or int8 + scales


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: KVCache,
                    v_cache: KVCache, meta: AttentionMetadata, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """q [N, H, D], k/v [N, KVH, D] for the new tokens; caches [slots, KVH, D]. Returns [N, H, D]."""
    if window is not None and meta.windowed is not None:
        meta = meta.windowed  # this layer's caches are the sliding-window group's
    _write(k_cache, meta.slot_mapping, k)
    _write(v_cache, meta.slot_mapping, v)
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
    for group in meta.decodes:
        if meta.native is not None:
            o = _native_decode(meta.native, q[group.rows].float().contiguous(), k_cache, v_cache, group, scale,
                               window)
            out[group.rows] = o.to(q.dtype)
        else:
            out[group.rows] = _decode(q[group.rows], k_cache, v_cache, group, scale, window, gqa)
    for p in meta.prefills:
        qp = q[p.start:p.start + p.query_len].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        kp = _rows(k_cache, p.slots, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, D]
        vp = _rows(v_cache, p.slots, q.dtype).transpose(0, 1).unsqueeze(0)
        mask = p.masks[window]
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None,
                                           scale=scale, enable_gqa=gqa)
        out[p.start:p.start + p.query_len] = o[0].transpose(0, 1)
    return out


def _decode(q, k_cache, v_cache, group: DecodeGroup, scale, window, gqa) -> torch.Tensor:
    b = q.shape[0]
    kd = _gather_blocks(k_cache, group, q.dtype)
    kd = kd.view(b, -1, *kd.shape[1:]).transpose(1, 2)  # [B, KVH, L, D]
    vd = _gather_blocks(v_cache, group, q.dtype)
    vd = vd.view(b, -1, *vd.shape[1:]).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=group.masks[window],
                                       scale=scale, enable_gqa=gqa)  # [B, H, 1, D]
    return o.squeeze(2)


def _write(cache: KVCache, slots: torch.Tensor, x: torch.Tensor) -> None:
    if isinstance(cache, Int8KV):
        cache.write(slots, x)
    else:
        cache.index_copy_(0, slots, x)


def _rows(cache: KVCache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return cache.rows(slots, dtype) if isinstance(cache, Int8KV) else cache[slots]


def _native_decode(native, q, k_cache: KVCache, v_cache: KVCache, group: DecodeGroup, scale, window):
    """The compiled kernel, reading int8 rows and their scales in place when the cache is int8."""
    if isinstance(k_cache, Int8KV):
        return native.paged_decode_int8(q, k_cache.data, k_cache.scale, v_cache.data, v_cache.scale, group.tables,
                                        group.lens, scale, window or -1, group.block_size)
    return native.paged_decode(q, k_cache, v_cache, group.tables, group.lens, scale, window or -1, group.block_size)


def _gather_blocks(cache: KVCache, group: DecodeGroup, dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks (block_size x KVH x D contiguous) copied at once: much cheaper than
    gathering token rows."""
    if isinstance(cache, Int8KV):
        return cache.gather_blocks(group.block_ids, group.block_size, dtype)
    per_block = group.block_size * cache.shape[1] * cache.shape[2]
    return cache.view(-1, per_block).index_select(0, group.block_ids)
