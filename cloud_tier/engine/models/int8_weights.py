"""Weight-only INT8 (``EngineConfig.weight_dtype = "int8"``, applied by quantize.py): the decoder's
linear layers (qkv, o, gate_up, down) keep int8 weights with one float32 scale per output channel
(symmetric: w ~ q * scale, q in [-127, 127], scale = max|w| / 127 over the channel's row);
activations, embeddings and norms stay in the engine dtype. A decode step on a CPU reads every
weight once, so its time is the weight bytes: half of bfloat16's, a quarter of float32's.

Batches of up to ``KERNEL_MAX_ROWS`` rows (decode) multiply in the CPU kernel (kernels/
int8_linear_cpu.cpp), which widens each int8 row in registers; larger ones (prefill chunks, where
the product is compute-bound and oneDNN's dense kernels are several times faster) dequantize the
weight to the activations' dtype and run F.linear. Where the kernels are not loaded (no compiler,
CUDA) every batch takes the dense path: the same numbers, more slowly."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Up to this many rows the kernel beat the dense path (dequantize + F.linear), by dtype: measured on
# the 1.5B's shapes (1536x17920, 8960x1536) on 2 threads of a Sapphire Rapids (AMX), with weights in
# cache and before the kernel ran all rows per weight tile (since then it is faster at 8+ rows: these
# limits are conservative); float32's dense products are slower, so the kernel stays ahead longer.
KERNEL_MAX_ROWS = {torch.bfloat16: 16, torch.float32: 32}
# The dense path dequantizes a weight this many bytes at a time into a reused buffer (about an L2):
# the slice is multiplied while in cache, where a whole dequantized copy went to memory and back
SLICE_BYTES = 2 << 20


@dataclass
class Int8Weight:
    """A weight [N, K] as int8 ``data`` and float32 ``scale`` [N]: w ~ data * scale[:, None]."""

    data: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # an all-zero row: zeros at any scale
        data = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(data.contiguous(), scale.contiguous())

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight this stands for, in ``dtype`` (computed in float32, then rounded once)."""
        return (self.data.float() * self.scale[:, None]).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scale.numel()


def int8_product(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None, ext) -> torch.Tensor:
    """x @ (data * scale).T (+ bias) in x's dtype: the kernel ``ext`` for decode-size batches on the
    CPU (float32 or bfloat16 rows), else dense on the dequantized weight (in cache-sized slices where
    the kernels are loaded, whole without them)."""
    if ext is None or x.dim() != 2 or x.device.type != "cpu" or x.dtype not in KERNEL_MAX_ROWS:
        return F.linear(x, weight.dequantized(x.dtype), bias)
    if x.shape[0] <= KERNEL_MAX_ROWS[x.dtype]:
        return ext.int8_linear(x.contiguous(), weight.data, weight.scale, bias)
    n, k = weight.data.shape
    rows = max(16, SLICE_BYTES // (k * x.element_size()))
    buf = _slice_buffer(min(rows, n), k, x.dtype)
    outs = []
    for start in range(0, n, rows):
        part = buf[:min(rows, n - start)]
        ext.int8_dequantize_(part, weight.data[start:start + rows], weight.scale[start:start + rows])
        outs.append(F.linear(x, part, None if bias is None else bias[start:start + rows]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


_buffers = threading.local()  # per thread: two engines of one process step at once


def _slice_buffer(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A reused [rows, cols] buffer for one slice of a dequantized weight (a fresh one per slice
    would fault its pages in every time)."""
    cache = getattr(_buffers, "by_shape", None)
    if cache is None:
        cache = _buffers.by_shape = {}
    buf = cache.get((rows, cols, dtype))
    if buf is None:
        with torch.inference_mode(False):
            buf = cache[rows, cols, dtype] = torch.empty(rows, cols, dtype=dtype)
    return buf
