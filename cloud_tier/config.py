"""The cloud tier's configuration: ``cloud.toml``, overridden by ``CASCADE_CLOUD_<SECTION>_<KEY>``."""

from __future__ import annotations

from dataclasses import dataclass, field

from cascade.config import load_config

ROLES = ("both", "prefill", "decode")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8100
    api_key: str = ""  # a worker may require a bearer key of its callers (the gateway)
    max_body_bytes: int = 4 << 20
    log_level: str = "info"

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")


@dataclass
class EngineSection:
    model: str = "smollm2-135m"
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    max_model_len: int = 2048
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    threads: int = 0


@dataclass
class WorkerConfig:
    role: str = "both"  # both: co-located prefill and decode; prefill | decode: one half of a pair
    kv_host: str = ""  # where the KV receiver listens (decode, both); "": the server's host
    kv_port: int = 0  # 0: any free port (reported in /healthz and /internal/load)
    prefill_timeout_s: float = 120.0  # a decode worker's wait for a prefill and its KV

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")


@dataclass
class CloudConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineSection = field(default_factory=EngineSection)
    worker: WorkerConfig = field(default_factory=WorkerConfig)

    @classmethod
    def load(cls, path=None, overrides=None, environ=None) -> CloudConfig:
        return load_config(cls, "cloud", path, overrides, environ)
