"""Building blocks shared by the model definitions (HF parameter layout and numerics)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in float32, scale by ``weight`` in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * _normalized(x, self.eps).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 and applied in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_normalized(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) in float32, as HF computes it, in one fused op (the composite
    was five ops of thread start-up each, twice per layer); the weight stays a separate multiply
    so its rounding is HF's."""
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps)


class Rotary(nn.Module):
    """Rotary position embedding in HF's rotate-half layout, cos/sin cached up to max_pos."""

    def __init__(self, head_dim: int, theta: float, max_pos: int, scaling: float = 1.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        t = torch.arange(max_pos, dtype=torch.float32) / scaling
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [N, 1, D] of ``positions`` in ``dtype``: looked up once per step,
        shared by every layer. The sin's first half is negated, so that ``apply_rotary`` needs no
        negation of x (-(a) * b == a * (-b) exactly)."""
        cos, sin = self.cos[positions].to(dtype), self.sin[positions].to(dtype)
        half = sin.shape[-1] // 2
        return cos.unsqueeze(1), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).unsqueeze(1)


def apply_rotary(rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated by ``Rotary.at``'s (cos, signed sin), in HF's rotate-half layout:
    x * cos + cat(-x2, x1) * sin."""
    cos, signed_sin = rope
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
