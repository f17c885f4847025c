"""Runs one scheduled step on the model: flattens the batch, builds the attention metadata,
computes logits only where a token is sampled, and samples."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cloud_tier.engine.attention import AttentionMetadata
from cloud_tier.engine.kv_quant import Int8KV
from cloud_tier.engine.sampler import Sampler, TokenLogprobs
from cloud_tier.engine.scheduling.output import SchedulerOutput

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV cache tensor. On Linux CPUs its pages are advised huge (MADV_HUGEPAGE) before
    they are first touched: decode attention reads a block here and a block there across gigabytes,
    and with 2 MiB pages far fewer of those reads miss the TLB (about 5% of the attention's time
    at serving shapes here, where transparent huge pages are "madvise"). Where the advice is not
    taken (another OS, THP off) the tensor is the same, on 4 KiB pages."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype)
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    lo, hi = -(-start // _HUGE_PAGE) * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE
    if hi > lo:
        try:
            ctypes.CDLL(None).madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE)
        except (OSError, AttributeError):  # no libc symbol: the advice is an optimization only
            pass
    return t.zero_()


@dataclass
class ModelOutput:
    sampled: dict[str, int]  # request id -> token, for requests that reached their last token
    logprobs: dict[str, TokenLogprobs]
    logits: dict[str, torch.Tensor] | None = None  # kept only when asked (parity tests)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why no token could be sampled
    # request id -> the accepted prefix of its proposed tokens (which come before its sampled token)
    accepted: dict[str, list[int]] = field(default_factory=dict)


class ModelRunner:
    """``kv_cache_dtype``: "auto" stores K/V in the model's ``dtype``; "int8" stores them quantized
    (``kv_quant.Int8KV``), which the attention reads directly."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, seed: int = 0, kv_cache_dtype: str = "auto", num_window_blocks: int = 0,
                 window_block_ids: Callable[[str], list[int]] | None = None):
        """``kv_cache_dtype``: "int8" stores K/V as int8 with per-token, per-head scales (else the
        model's dtype); ``num_window_blocks``: the sliding-window layers' own blocks (0: they share
        the others'), and ``window_block_ids``: a request's block table for them (the KV cache manager's)."""
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_int8 = kv_cache_dtype == "int8"
        _, n_kv, head_dim = model.kv_shape

        def cache(shape):
            return Int8KV.zeros(shape, device) if self.kv_int8 else _kv_zeros(shape, dtype, device)

        self.kv_caches = []
        for window in model.layer_windows():
            n = num_window_blocks if window is not None and num_window_blocks else num_blocks
            shape = (n * block_size, n_kv, head_dim)
            self.kv_caches.append((cache(shape), cache(shape)))
        self.separate_windows = bool(num_window_blocks) and any(w is not None for w in model.layer_windows())
        self.window_block_ids = window_block_ids
        self.windows = model.sliding_windows()
        self.keep_logits = False
        self.native_attention = None
        if device.type == "cpu":
            from cloud_tier.engine import kernels
            from cloud_tier.engine.models import layers

            self.native_attention = kernels.load()
            layers.use_native(self.native_attention)  # the element-wise ops from the same extension
            layers.pack_linears(model)  # the weights packed once for oneDNN (float32: where faster)
        self.sampler = Sampler(seed, device, self.native_attention)

    @staticmethod
    def bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype,
                        kv_cache_dtype: str = "auto") -> int:
        """One block's K and V across layers, scales included: the unit of the KV budget and of
        a transfer's payload."""
        num_layers, n_kv, head_dim = model.kv_shape
        row = (Int8KV.bytes_per_row(head_dim) if kv_cache_dtype == "int8"
               else head_dim * torch.empty((), dtype=dtype).element_size())
        return 2 * num_layers * block_size * n_kv * row

    def kv_block_shape(self) -> tuple[int, int, int, int]:
        """(num_layers, block_size, num_kv_heads, head_dim): one block's K (or V) across layers."""
        k = self.kv_caches[0][0]
        k = k.data if self.kv_int8 else k
        return len(self.kv_caches), self.block_size, k.shape[1], k.shape[2]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of these blocks' K and V as stored, shaped (layers, 2, blocks, block_size, kv_heads,
        head_dim) in the model dtype, or for an int8 cache (..., head_dim + 4) int8 (each row with its
        scale's bytes, ``kv_quant.pack``), on the CPU: the payload of a KV transfer."""
        idx = torch.tensor(block_ids, device=self.device)
        _, bs, n_kv, hd = self.kv_block_shape()
        if self.kv_int8:
            out = torch.stack([torch.stack([k.read_blocks(idx, bs), v.read_blocks(idx, bs)])
                               for k, v in self.kv_caches])
        else:
            out = torch.stack([torch.stack([k.view(-1, bs, n_kv, hd)[idx], v.view(-1, bs, n_kv, hd)[idx]])
                               for k, v in self.kv_caches])
        return out.cpu()

    def check_payload(self, kv: torch.Tensor, num_blocks: int) -> None:
        """ValueError unless ``kv`` is ``num_blocks`` blocks in ``read_blocks``' layout here."""
        layers, bs, n_kv, hd = self.kv_block_shape()
        row, dtype = (Int8KV.bytes_per_row(hd), torch.int8) if self.kv_int8 else (hd, self.dtype)
        expected = (layers, 2, num_blocks, bs, n_kv, row)
        if tuple(kv.shape) != expected or kv.dtype != dtype:
            raise ValueError(f"KV payload {tuple(kv.shape)} {kv.dtype} does not match this cache's "
                             f"{expected} {dtype}")

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write a transfer's payload (``read_blocks``' layout) into these blocks."""
        self.check_payload(kv, len(block_ids))
        _, bs, n_kv, hd = self.kv_block_shape()
        idx = torch.tensor(block_ids, device=self.device)
        kv = kv.to(self.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            if self.kv_int8:
                k.write_blocks(idx, bs, kv[layer, 0])
                v.write_blocks(idx, bs, kv[layer, 1])
            else:
                k.view(-1, bs, n_kv, hd)[idx] = kv[layer, 0]
                v.view(-1, bs, n_kv, hd)[idx] = kv[layer, 1]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        ids, chunks, sample_rows, sample_reqs, spec = [], [], [], [], []
        row = 0
        for s in out.scheduled:
            req, start, n = s.request, s.start, s.num_new_tokens
            ids.extend(req.token_ids[start:start + s.num_known_tokens])
            ids.extend(s.spec_token_ids)
            chunks.append((start, n, s.block_ids))
            row += n
            if s.samples and s.spec_token_ids:  # logits at the last known token and at each proposed one
                spec.append((s, len(sample_rows)))
                sample_rows.extend(range(row - 1 - len(s.spec_token_ids), row))
            elif s.samples:
                sample_rows.append(row - 1)
                sample_reqs.append(req)
        dev = self.device
        meta = AttentionMetadata.build(chunks, self.block_size, self.windows, dev, self.native_attention)
        if self.separate_windows:
            local = [(s.start, s.num_new_tokens, self.window_block_ids(s.request.request_id)) for s in out.scheduled]
            meta.windowed = AttentionMetadata.build(local, self.block_size, self.windows - {None}, dev,
                                                    self.native_attention)
        hidden = self.model(torch.tensor(ids, device=dev), meta.positions, self.kv_caches, meta)
        if not sample_rows:
            return ModelOutput({}, {})
        if len(sample_rows) < row:
            hidden = hidden[torch.tensor(sample_rows, device=dev)]
        # in the model's dtype: the sampler widens to float32 only where it computes more than an argmax
        logits = self.model.compute_logits(hidden)
        result = self._verify(logits, spec)
        if sample_reqs and spec:  # the plain rows, in order, are those no proposal took
            taken = {i for s, first in spec for i in range(first, first + len(s.spec_token_ids) + 1)}
            logits = logits[torch.tensor([i for i in range(len(sample_rows)) if i not in taken], device=dev)]
        if sample_reqs:
            self._sample(logits, sample_reqs, result)
        return result

    def _verify(self, logits: torch.Tensor, spec: list) -> ModelOutput:
        """The verdicts on the proposed tokens of the rows ``spec`` lists (scheduled, first logits row)."""
        result = ModelOutput({}, {}, accepted={})
        for s, first in spec:
            rid = s.request.request_id
            verdict = self.sampler.verify(logits[first:first + len(s.spec_token_ids) + 1], s.request,
                                          s.spec_token_ids)
            if isinstance(verdict, str):
                result.failed[rid] = verdict
            else:
                result.sampled[rid], result.accepted[rid] = verdict.token, verdict.accepted
        return result

    def _sample(self, logits: torch.Tensor, sample_reqs: list, into: ModelOutput) -> None:
        sampled = self.sampler(logits, sample_reqs)
        failed = {sample_reqs[i].request_id: why for i, why in sampled.errors.items()}
        into.failed.update(failed)
        into.sampled.update((r.request_id, t) for r, t in zip(sample_reqs, sampled.token_ids, strict=True)
                            if r.request_id not in failed)
        into.logprobs.update((r.request_id, lp) for r, lp in zip(sample_reqs, sampled.logprobs, strict=True)
                             if lp is not None)
        if self.keep_logits:
            into.logits = {r.request_id: row.float() for r, row in zip(sample_reqs, logits.cpu(), strict=True)}
