"""Building blocks shared by the model definitions (HF parameter layout and numerics).

On a CPU the element-wise ones run as the compiled kernels (``cloud_tier.engine.kernels``) once
the model runner has loaded them (``use_native``): one pass over the rows each, where torch runs
several ops; the torch code beside them is what CUDA, and a CPU without a compiler, run, and the
reference the kernels are tested against."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from cloud_tier.engine.attention import heads_contiguous
from cloud_tier.engine.models.int8_weights import Int8Weight, int8_product
from cloud_tier.engine_config import has_amx

log = logging.getLogger(__name__)

_native: dict[str, object] = {}  # "ext": the loaded CPU kernels, once use_native gave them


def use_native(ext) -> None:
    """Run the element-wise ops on CPU tensors through ``ext`` (None: the torch code)."""
    if ext is None:
        _native.pop("ext", None)
    else:
        _native["ext"] = ext


def _ext(x: torch.Tensor):
    return _native.get("ext") if x.device.type == "cpu" and x.dtype != torch.float64 else None


def _norm_ext(x: torch.Tensor, weight: torch.Tensor):
    """The kernels, where an RMSNorm of ``x`` (rows, or heads of strided rows) can run in them."""
    ext = _ext(x)
    return ext if ext is not None and weight.dtype == x.dtype and x.dim() in (2, 3) and x.stride(-1) == 1 else None


PACKED_MAX_ROWS = 512  # bfloat16: above it (prefill chunks) F.linear was as fast or faster here
# float32 goes through the packed copy (where pack_linears measured it faster) from 2 rows up, at
# any count: one row is a matrix-vector product, where MKL's (F.linear) beat oneDNN's call
# overhead on the layers (39 vs 94 us on a 960x576 weight, measured on an EPYC); the LM head, 85
# times larger, is packed from one row (5.5 vs 11 ms there).
FP32_PACKED_MIN_ROWS = 2
# On AMX, oneDNN's bfloat16 product of more than ~160 rows runs 20-40% slower when the rows are
# not a whole number of its 16-row tiles (measured here at 175-250 rows: 200 rows took longer than
# 208); below that, padding cost more than it saved. Such batches are padded with zero rows (the
# products of the real rows are bit for bit the same) and the padding dropped from the result.
PAD_TILE_ROWS, PAD_FROM_ROWS = 16, 160
_pad_rows = has_amx() and os.environ.get("CASCADE_ENGINE_PAD_ROWS", "1") not in ("0", "false", "no")


class Linear(nn.Linear):
    """nn.Linear that, once ``pack_linears`` has run on a CPU model, multiplies through oneDNN with
    its weight packed once: in bfloat16 the same products bit for bit as F.linear (1.2-2x faster
    below a few hundred rows, the decode batches); in float32, where it measured faster on this
    CPU, products that differ from MKL's in the last bits (1.3-1.6x faster on an EPYC, where MKL
    runs these shapes at ~110-180 GFLOPS). The packed copy is made from the weight at that time:
    load weights before packing."""

    packed: torch.Tensor | None = None
    int8: Int8Weight | None = None  # quantize.quantize_model's (weight_dtype "int8"): then no float weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return int8_product(x, self.int8, self.bias, _ext(x))
        return _linear(x, self.weight, self.bias, self.packed)


def head_linear(model: nn.Module, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The LM head's product (``weight``: the head's, or the tied embedding's), packed as the layers',
    or from its INT8 copy where ``quantize_model`` made one."""
    int8 = getattr(model, "int8_head", None)
    if int8 is not None:
        return int8_product(hidden, int8, None, _ext(hidden))
    return _linear(hidden, weight, None, getattr(model, "packed_head", None), min_rows=1)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            packed: torch.Tensor | None, min_rows: int = FP32_PACKED_MIN_ROWS) -> torch.Tensor:
    """x @ weight.T (+ bias): through the packed copy where it applies, else F.linear."""
    if packed is not None and x.dim() == 2 and x.dtype == weight.dtype and x.device.type == "cpu":
        rows = x.shape[0]
        if x.dtype == torch.float32:
            if rows >= min_rows:
                return packed_product(x, packed, bias)
        elif rows <= PACKED_MAX_ROWS:
            if _pad_rows and rows > PAD_FROM_ROWS and rows % PAD_TILE_ROWS:
                padded = _pad_buffer(rows + (-rows % PAD_TILE_ROWS), x.shape[1], x.dtype)
                padded[:rows] = x
                return packed_product(padded, packed, bias)[:rows]
            return packed_product(x, packed, bias)
    return F.linear(x, weight, bias)


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) through oneDNN on ``packed``, the weight's reordered copy."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_pad_buffers = threading.local()  # per thread (two engines of one process step at once)


def _pad_buffer(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A reused [rows, cols] input of a padded product (a fresh zeroed one cost 4-5x the copy into
    it): the caller overwrites the real rows; rows past any real ones stay what an earlier,
    larger batch left there, harmless (each product row depends on its own input row only)."""
    cache = getattr(_pad_buffers, "by_shape", None)
    if cache is None:
        cache = _pad_buffers.by_shape = {}
    buf = cache.get((rows, cols, dtype))
    if buf is None:
        with torch.inference_mode(False):  # writable in and out of inference mode
            buf = cache[rows, cols, dtype] = torch.zeros(rows, cols, dtype=dtype)
    return buf


FP32_PACKED_GAIN = 1.15  # float32 is packed only where that many times faster: noise cannot flip it
# The choice, per process (every engine of it multiplies the same way) and kept on disk beside the
# kernel builds (every process of this machine, a prefill and a decode worker alike, too).
_fp32_choice: dict[str, bool] = {}
_fp32_lock = threading.Lock()


def pack_linears(model: nn.Module, rows_hint: int = 256) -> int:
    """Pack every ``Linear`` weight of a CPU model (and its LM head) for oneDNN; returns how many
    were packed. bfloat16 is always packed; float32 where one decoder layer's weights and the head
    multiply at least FP32_PACKED_GAIN times faster packed than through F.linear, timed here on
    ``rows_hint`` rows once per machine, torch, thread count and weight shapes
    (CASCADE_ENGINE_PACKED_LINEAR=float32: without timing). 0 where it does not apply: another
    dtype or device, no oneDNN, float32 not faster, or CASCADE_ENGINE_PACKED_LINEAR=0."""
    mode = os.environ.get("CASCADE_ENGINE_PACKED_LINEAR", "1")
    if mode in ("0", "false", "no"):
        return 0
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is None or not torch.backends.mkldnn.is_available():
        return 0
    lm_head = getattr(model, "lm_head", None)
    head = model.embed_tokens.weight if lm_head is None else lm_head.weight
    if head.device.type != "cpu" or head.dtype not in (torch.bfloat16, torch.float32):
        return 0
    int8_head = getattr(model, "int8_head", None) is not None  # an untied head's float weight is emptied then
    if int8_head and not any(isinstance(m, Linear) and m is not lm_head and m.int8 is None for m in model.modules()):
        return 0  # weight_dtype "int8": nothing left in a float dtype to pack
    with torch.inference_mode():
        if head.dtype == torch.float32 and mode != "float32" and not _fp32_packed_faster(
                model, None if int8_head else head, rows_hint):
            return 0
        count = 0
        for m in model.modules():
            if isinstance(m, Linear) and m is not lm_head and m.int8 is None:  # the head: packed_head
                m.packed = reorder(m.weight.detach(), rows_hint)
                count += 1
        if int8_head:  # multiplied from its INT8 copy
            return count
        model.packed_head = reorder(head.detach(), rows_hint)
    return count + 1


def _fp32_packed_faster(model: nn.Module, head: torch.Tensor | None, rows: int) -> bool:
    """Whether float32 products on packed weights beat F.linear here by FP32_PACKED_GAIN: the
    first decoder layer's weights and the head, each way best of 3 after a warm-up, interleaved;
    timed once per machine, torch, thread count and shapes, then read back."""
    from cloud_tier.engine import kernels

    blocks = getattr(model, "layers", None)
    layer = [m.weight.detach() for m in blocks[0].modules()
             if isinstance(m, Linear) and m.int8 is None] if blocks else []
    weights = [*layer, *([] if head is None else [head.detach()])]
    shapes = " ".join("x".join(map(str, w.shape)) for w in weights)
    key = f"{torch.__version__} threads={torch.get_num_threads()} rows={rows} {shapes}"
    with _fp32_lock:  # two engines loading at once: one times, the other takes its choice
        if key not in _fp32_choice:
            machine = hashlib.sha256(kernels.machine_key().encode()).hexdigest()[:12]
            path = kernels.cache_root() / f"linear-choice-{machine}.json"
            kept = _read_choices(path)
            if key in kept:
                _fp32_choice[key] = kept[key]
            else:
                _fp32_choice[key] = _time_fp32(weights, rows)
                _write_choices(path, {**kept, key: _fp32_choice[key]})
        return _fp32_choice[key]


def _time_fp32(weights: list[torch.Tensor], rows: int) -> bool:
    spent = {"F.linear": 0.0, "packed": 0.0}
    for w in weights:
        x = torch.randn(rows, w.shape[1])
        p = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        ways = {"F.linear": (F.linear, (x, w)),
                "packed": (packed_product, (x, p))}
        best = dict.fromkeys(ways, float("inf"))
        for round_ in range(4):
            for way, (product, args) in ways.items():
                start = time.perf_counter()
                product(*args)
                if round_:  # round 0 warms both up
                    best[way] = min(best[way], time.perf_counter() - start)
        for way in ways:
            spent[way] += best[way]
    faster = spent["F.linear"] >= FP32_PACKED_GAIN * spent["packed"]
    log.info("float32 linears on %s: F.linear %.1f ms, packed %.1f ms (%d rows)",
             "the packed weights" if faster else "F.linear", spent["F.linear"] * 1e3, spent["packed"] * 1e3, rows)
    return faster


def _read_choices(path) -> dict[str, bool]:
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: timed again
        return {}
    return {k: v for k, v in kept.items() if isinstance(v, bool)} if isinstance(kept, dict) else {}


def _write_choices(path, choices: dict[str, bool]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(choices, indent=1))
        os.replace(tmp, path)  # whole or not at all, for a process reading beside this one
    except OSError as e:  # a read-only home: the choice holds for this process only
        log.warning("could not keep the float32 linear choice in %s (%s)", path, e)


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in float32, scale by ``weight`` in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ext = _norm_ext(x, self.weight)
        if ext is not None:
            return ext.rms_norm(x, self.weight, self.eps, False)
        return self.weight * _normalized(x, self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += x`` (in place, in its dtype), then this norm of it: a layer's residual add
        fused with the next norm."""
        ext = _ext(x)
        if (ext is not None and self.weight.dtype == x.dtype == residual.dtype and x.dim() == 2
                and x.is_contiguous() and residual.is_contiguous()):
            return ext.add_rms_norm(x, residual, self.weight, self.eps)
        residual.add_(x)
        return self(residual)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 and applied in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ext = _norm_ext(x, self.weight)
        if ext is not None:
            return ext.rms_norm(x, self.weight, self.eps, True)
        return (_normalized(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up over [N, 2I] (gate | up), the activation stored in the dtype first (HF's order)."""
    ext = _ext(gate_up)
    if ext is not None and gate_up.is_contiguous() and gate_up.dim() == 2:
        return ext.act_and_mul(gate_up, 0)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)  # in the projection's own output


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate, tanh approximation) * up over [N, 2I] (gate | up)."""
    ext = _ext(gate_up)
    if ext is not None and gate_up.is_contiguous() and gate_up.dim() == 2:
        return ext.act_and_mul(gate_up, 1)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) in float32, as HF computes it, in one fused op (the composite
    was five ops of thread start-up each, twice per layer); the weight stays a separate multiply
    so its rounding is HF's."""
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps)


class Rotary(nn.Module):
    """Rotary position embedding in HF's rotate-half layout, cos/sin cached up to max_pos."""

    def __init__(self, head_dim: int, theta: float, max_pos: int, scaling: float = 1.0):
        super().__init__()
        with torch.device("cpu"):  # computed, never loaded: real even where the loader builds the model on meta
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            t = torch.arange(max_pos, dtype=torch.float32) / scaling
            freqs = torch.outer(t, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAt:
        """The rotation of one step's rows: shared by every layer."""
        return RopeAt(self, positions, dtype)


@dataclass
class RopeAt:
    """``Rotary`` at one step's ``positions``. The torch path's (cos, signed sin) [N, 1, D] in the
    model dtype are looked up once, on first use; the sin's first half is negated, so that
    ``apply_rotary`` needs no negation of x (-(a) * b == a * (-b) exactly). The CPU kernel reads
    the float32 tables at the positions itself."""

    rotary: Rotary
    positions: torch.Tensor
    dtype: torch.dtype
    _pair: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pair is None:
            cos = self.rotary.cos[self.positions].to(self.dtype)
            sin = self.rotary.sin[self.positions].to(self.dtype)
            half = sin.shape[-1] // 2
            self._pair = cos.unsqueeze(1), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).unsqueeze(1)
        return self._pair


def apply_rotary(rope: RopeAt, x: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated in HF's rotate-half layout: x * cos + cat(-x2, x1) * sin. On a CPU
    with the kernels, and x's heads contiguous, x is rotated in place (and returned)."""
    ext = _ext(x)
    if ext is not None and heads_contiguous(x):
        ext.rotary_(x, rope.positions, rope.rotary.cos, rope.rotary.sin)
        return x
    cos, signed_sin = rope.pair()
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


def rope_theta(config: dict, layer_type: str | None = None) -> tuple[float, float]:
    """(theta, linear scaling factor) from an HF config of transformers 4.x or 5.x."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        kind = params.get("rope_type", "default")
        if kind not in ("default", "linear"):
            raise NotImplementedError(f"rope_type {kind!r} is not supported yet")
        return float(params["rope_theta"]), float(params.get("factor", 1.0)) if kind == "linear" else 1.0
    if layer_type == "sliding_attention" and "rope_local_base_freq" in config:
        return float(config["rope_local_base_freq"]), 1.0
    scaling = config.get("rope_scaling") or {}
    factor = float(scaling.get("factor", 1.0)) if scaling.get("rope_type", scaling.get("type")) == "linear" else 1.0
    return float(config.get("rope_theta", 10000.0)), factor
