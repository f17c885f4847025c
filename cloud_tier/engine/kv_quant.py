"""INT8 KV cache storage: each cached K (or V) row of one head is stored as int8 with one float32
scale (symmetric, ``absmax / 127`` over head_dim), so a block takes about a quarter of float32's
bytes (half of bfloat16's) and decode, which is memory-bound, reads that much less.

    cache = Int8KV.zeros((slots, kv_heads, head_dim), device)
    cache.write(slot_mapping, k)           # quantize on write
    k_rows = cache.rows(slots, q.dtype)    # dequantize on read

A transfer payload (``ModelRunner.read_blocks``) carries the cache as stored: int8 rows with their
scale's 4 bytes appended (``pack``), so the receiver gets exactly what the sender held.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_BYTES = 4  # float32
_TINY = torch.finfo(torch.float32).tiny


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., D] as (int8 [..., D], float32 scale [...]) with ``x ~= q * scale``; an all-zero
    row gets scale 0 (and zeros)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / 127.0
    q = torch.round(x / scale.clamp_min(_TINY).unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., D] and their scales [...] as one int8 tensor [..., D + 4]: the scale's bytes
    (native byte order, as every payload) after each row."""
    return torch.cat([q, scale.contiguous().unsqueeze(-1).view(torch.int8)], dim=-1)


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack``'s inverse: (int8 [..., D], float32 scale [...])."""
    d = packed.shape[-1] - SCALE_BYTES
    return packed[..., :d], packed[..., d:].contiguous().view(torch.float32).squeeze(-1)


@dataclass
class Int8KV:
    """One layer's K (or V) cache: ``data`` [slots, kv_heads, head_dim] int8 and ``scale``
    [slots, kv_heads] float32, written and read by slot like a float cache tensor."""

    data: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def zeros(cls, shape: tuple[int, int, int], device: torch.device) -> Int8KV:
        return cls(torch.zeros(shape, dtype=torch.int8, device=device),
                   torch.zeros(shape[:2], dtype=torch.float32, device=device))

    @staticmethod
    def bytes_per_row(head_dim: int) -> int:
        """Bytes one (slot, kv head) takes: the int8 row and its scale."""
        return head_dim + SCALE_BYTES

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        q, scale = quantize(x)
        self.data.index_copy_(0, slots, q)
        self.scale.index_copy_(0, slots, scale)

    def rows(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows at ``slots``, dequantized: [len(slots), kv_heads, head_dim]."""
        return dequantize(self.data[slots], self.scale[slots], dtype)

    def gather_blocks(self, block_ids: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """Whole blocks, dequantized: [len(block_ids) * block_size, kv_heads, head_dim]."""
        _, n_kv, hd = self.data.shape
        q = self.data.view(-1, block_size * n_kv * hd).index_select(0, block_ids)
        s = self.scale.view(-1, block_size * n_kv).index_select(0, block_ids)
        return dequantize(q.view(-1, n_kv, hd), s.view(-1, n_kv), dtype)

    def read_blocks(self, idx: torch.Tensor, block_size: int) -> torch.Tensor:
        """These blocks as stored, packed: int8 [blocks, block_size, kv_heads, head_dim + 4]."""
        _, n_kv, hd = self.data.shape
        return pack(self.data.view(-1, block_size, n_kv, hd)[idx], self.scale.view(-1, block_size, n_kv)[idx])

    def write_blocks(self, idx: torch.Tensor, block_size: int, packed: torch.Tensor) -> None:
        """Store ``read_blocks``' output into the blocks ``idx``, unchanged."""
        _, n_kv, hd = self.data.shape
        q, scale = unpack(packed)
        self.data.view(-1, block_size, n_kv, hd)[idx] = q
        self.scale.view(-1, block_size, n_kv)[idx] = scale
