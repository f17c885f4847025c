"""What one engine hands another in disaggregated serving: the request with its prompt's KV,
and the identity that says whether that KV means anything to the receiver."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cloud_tier.engine.request import Request
from cloud_tier.engine.sampler import TokenLogprobs


class KVCapacityError(RuntimeError):
    """An adopted request's KV does not fit the free blocks right now."""


@dataclass(frozen=True)
class KVLayout:
    """How an engine's KV cache lays out one block (``ModelRunner.read_blocks``' payload)."""

    block_size: int
    dtype: str  # as stored: the model's dtype, or "int8" (EngineConfig.kv_cache_dtype)
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __str__(self) -> str:
        return (f"kv(block_size={self.block_size},dtype={self.dtype},layers={self.num_layers},"
                f"kv_heads={self.num_kv_heads},head_dim={self.head_dim})")


def model_identity(model_name: str, dtype: str, layout: KVLayout) -> str:
    """Equal for two engines exactly when KV computed by one is valid in the other: the KV
    receiver refuses a transfer whose identity differs, before its payload."""
    return f"{model_name}:{dtype}:{layout}"


@dataclass
class KVHandoff:
    """A request prefilled here for another worker: its record, first token's logprobs, seeded
    random state, and its prompt's KV blocks (``ModelRunner.read_blocks`` layout)."""

    request: Request
    logprobs: list[TokenLogprobs]
    sampler_state: bytes | None
    kv: torch.Tensor
