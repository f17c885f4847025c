"""The engine's configuration (one dataclass, validated on creation)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str  # catalogue name, .gguf path or HF directory
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30  # budget for K/V blocks ...
    num_kv_blocks: int | None = None  # ... or an exact number of blocks
    max_model_len: int = 2048
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024  # token budget of one step
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    seed: int = 0
    threads: int = 0  # torch intra-op threads on CPU; 0: torch's default

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be positive")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
