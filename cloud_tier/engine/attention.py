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
from itertools import chain

import numpy as np
import torch
import torch.nn.functional as F

from cloud_tier.engine.kv_quant import Int8KV

# with the native kernel, prefill chunks of contexts up to this many tokens run in it too (its cost
# grows with query x context, SDPA's is GEMM-shaped but ~0.23 ms a call for a 50-token prompt on 2
# cores). The prefill of the 200 ShareGPT prompts of bench/engine_throughput.py (bf16, AMX Xeon):
# SDPA for all 6.16 s; up to 40 tokens 5.73, 96: 5.55, 256: 5.25, 1024: 6.97
NATIVE_PREFILL_MAX = 256


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flat batch
    query_len: int
    context_len: int  # tokens of the request in the cache after this step
    slots: torch.Tensor  # [context_len] flat cache slots of positions 0..context_len-1
    masks: dict[int | None, torch.Tensor | None]  # sliding window (None: full) -> bool mask or None (plain causal)


@dataclass
class DecodeGroup:
    rows: slice | torch.Tensor  # [B] rows of the flat batch (a slice when they are consecutive)
    tables: torch.Tensor  # [B, max_blocks] block tables, padded with block 0
    lens: torch.Tensor  # [B] context lengths (the new token included)
    block_ids: torch.Tensor  # tables, flattened
    block_size: int
    masks: dict[int | None, torch.Tensor]  # sliding window -> [B, 1, 1, L] bool (none for the native kernel)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] where each new token's K/V is written
    positions: torch.Tensor  # [N] position of each row in its request
    decodes: list[DecodeGroup]  # decodes bucketed by context length, to pad less
    prefills: list[PrefillChunk]
    native: object | None = None  # the compiled CPU decode kernel, which reads blocks in place
    windowed: AttentionMetadata | None = None  # the sliding-window layers', when they have their own blocks

    @classmethod
    def build(cls, chunks: list[tuple[int, int, list[int]]], block_size: int, windows: set[int | None],
              device: torch.device, native: object | None = None,
              native_prefill_max: int = NATIVE_PREFILL_MAX) -> AttentionMetadata:
        """``chunks``: per request in batch order (num_computed_before, num_new, block_ids).
        Computed with numpy over the whole batch: a step of 200 decodes builds in well under a
        millisecond, where a few small torch ops per request took several. With the native
        kernel, a prefill chunk whose context is at most ``native_prefill_max`` tokens goes to it
        as well, each of its rows a query over the positions up to its own (one kernel call for
        the step instead of an SDPA per prompt)."""
        starts = np.fromiter((c[0] for c in chunks), np.int64, len(chunks))
        counts = np.fromiter((c[1] for c in chunks), np.int64, len(chunks))
        tables = _padded_tables([c[2] for c in chunks])
        first_rows = np.cumsum(counts) - counts
        rows_req = np.repeat(np.arange(len(chunks)), counts)  # the request of each row
        positions = np.arange(int(counts.sum())) - np.repeat(first_rows - starts, counts)
        slot_mapping = tables[rows_req, positions // block_size] * block_size + positions % block_size
        ctx = starts + counts
        by_kernel = (counts == 1) | (ctx <= native_prefill_max) if native else counts == 1  # per request
        prefills = []
        for i in np.flatnonzero(~by_kernel).tolist():
            all_pos = np.arange(ctx[i])
            slots = torch.from_numpy(tables[i, all_pos // block_size] * block_size + all_pos % block_size)
            masks = {w: _prefill_mask(int(counts[i]), int(ctx[i]), w, device) for w in windows}
            prefills.append(PrefillChunk(int(first_rows[i]), int(counts[i]), int(ctx[i]), slots.to(device), masks))
        if native:  # one group of rows in batch order: each row attends up to its own position
            rows = np.flatnonzero(by_kernel[rows_req])
            groups = [_decode_group(rows, tables[rows_req[rows]], positions[rows] + 1, block_size, set(), device)
                      ] if len(rows) else []
        else:
            decodes = np.flatnonzero(counts == 1)
            buckets = [np.sort(decodes[b]) for b in _buckets(ctx[decodes].tolist())]
            groups = [_decode_group(first_rows[b], tables[b], ctx[b], block_size, windows, device) for b in buckets]
        return cls(torch.from_numpy(slot_mapping).to(device), torch.from_numpy(positions).to(device), groups,
                   prefills, native)


def _padded_tables(tables: list[list[int]]) -> np.ndarray:
    """[R, max blocks] int64, padded with block 0."""
    lens = np.fromiter(map(len, tables), np.int64, len(tables))
    out = np.zeros((len(tables), int(lens.max(initial=1))), dtype=np.int64)
    out[np.arange(out.shape[1]) < lens[:, None]] = np.fromiter(chain.from_iterable(tables), np.int64, int(lens.sum()))
    return out


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


def _decode_group(rows: np.ndarray, tables: np.ndarray, lens: np.ndarray, block_size: int,
                  windows: set[int | None], device) -> DecodeGroup:
    max_blocks = int(-(-lens.max() // block_size))
    padded = torch.from_numpy(np.ascontiguousarray(tables[:, :max_blocks])).to(device)
    lens_t = torch.from_numpy(lens).to(device)[:, None]
    k_pos = torch.arange(max_blocks * block_size, device=device)[None, :]
    masks = {}
    for w in windows:
        m = k_pos < lens_t
        if w is not None:
            m &= (lens_t - 1) - k_pos < w
        masks[w] = m[:, None, None, :]
    consecutive = rows[-1] - rows[0] == len(rows) - 1  # rows ascend
    row_index = slice(int(rows[0]), int(rows[-1]) + 1) if consecutive else torch.from_numpy(rows).to(device)
    return DecodeGroup(row_index, padded, lens_t[:, 0], padded.flatten(), block_size, masks)


KVCache = torch.Tensor | Int8KV  # one layer's K (or V): [slots, KVH, D] in the model dtype, or int8 + scales


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: KVCache,
                    v_cache: KVCache, meta: AttentionMetadata, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """q [N, H, D], k/v [N, KVH, D] for the new tokens; caches [slots, KVH, D]. Returns [N, H, D]."""
    if window is not None and meta.windowed is not None:
        meta = meta.windowed  # this layer's caches are the sliding-window group's
    if (meta.native is not None and not isinstance(k_cache, Int8KV) and k.dtype == k_cache.dtype
            and heads_contiguous(k) and heads_contiguous(v)):
        meta.native.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)  # both in one pass
    else:
        _write(k_cache, meta.slot_mapping, k)
        _write(v_cache, meta.slot_mapping, v)
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
    for group in meta.decodes:
        if meta.native is not None:  # reads q's rows in place and writes the output's
            if isinstance(group.rows, slice):
                _native_decode(meta.native, q[group.rows], k_cache, v_cache, group, scale, window, out[group.rows])
            else:
                out[group.rows] = _native_decode(meta.native, q[group.rows], k_cache, v_cache, group, scale, window)
        else:
            out[group.rows] = _decode(q[group.rows], k_cache, v_cache, group, scale, window, gqa)
    for p in meta.prefills:
        rows = slice(p.start, p.start + p.query_len)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if p.context_len == p.query_len and not isinstance(k_cache, Int8KV):  # nothing before it: the rows just stored
            kp, vp = k[rows].transpose(0, 1).unsqueeze(0), v[rows].transpose(0, 1).unsqueeze(0)
        else:
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


def heads_contiguous(x: torch.Tensor) -> bool:
    """x [N, heads, D] with each row's heads contiguous (rows may be strided): the layout the CPU
    kernels read and write in place."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _write(cache: KVCache, slots: torch.Tensor, x: torch.Tensor) -> None:
    if isinstance(cache, Int8KV):
        cache.write(slots, x)
    else:
        cache.index_copy_(0, slots, x)


def _rows(cache: KVCache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache rows of ``slots`` in ``dtype``. index_select, not cache[slots]: the same rows, ~5x
    faster than advanced indexing on CPU."""
    return cache.rows(slots, dtype) if isinstance(cache, Int8KV) else cache.index_select(0, slots)


def _native_decode(native, q, k_cache: KVCache, v_cache: KVCache, group: DecodeGroup, scale, window, out=None):
    """The compiled kernel (q in the model dtype, each row's heads contiguous; the result in it, into
    ``out`` when given), reading int8 rows and their scales in place when the cache is int8."""
    if isinstance(k_cache, Int8KV):
        return native.paged_decode_int8(q, k_cache.data, k_cache.scale, v_cache.data, v_cache.scale, group.tables,
                                        group.lens, scale, window or -1, group.block_size, out)
    return native.paged_decode(q, k_cache, v_cache, group.tables, group.lens, scale, window or -1, group.block_size,
                               out)


def _gather_blocks(cache: KVCache, group: DecodeGroup, dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks (block_size x KVH x D contiguous) copied at once, much cheaper than gathering
    token rows: [blocks * block_size, KVH, D]."""
    if isinstance(cache, Int8KV):
        return cache.gather_blocks(group.block_ids, group.block_size, dtype)
    _, n_kv, hd = cache.shape
    per_block = group.block_size * n_kv * hd
    return cache.view(-1, per_block).index_select(0, group.block_ids).view(-1, n_kv, hd)
