"""Building blocks shared by the model definitions (HF parameter layout and numerics)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in float32, scale by ``weight`` in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 and applied in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


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

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [N, H, D], k [N, KVH, D] -> rotated, in their own dtype."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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
