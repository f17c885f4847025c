"""The edge agent's configuration: ``edge.toml``, overridden by ``CASCADE_EDGE_<SECTION>_<KEY>``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cascade.config import load_config


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8081
    api_key: str = ""  # when set, the local API needs "Authorization: Bearer <api_key>"
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    log_level: str = "info"

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")


@dataclass
class ModelConfig:
    name: str = "smollm2-135m"  # a catalogue name, or a path to a .gguf file
    backend: str = "llama.cpp"
    n_ctx: int = 2048
    n_batch: int = 256
    threads: int = 0  # decode threads per slot; 0: cores - 1 on machines of up to 4 cores, else all
    threads_batch: int = 0  # prompt threads per slot; 0: one per core
    parallel: int = 1  # slots: requests generated at the same time, each with its own context
    search_paths: list[Path] = field(default_factory=list)  # more folders with .gguf files

    def __post_init__(self):
        if self.backend != "llama.cpp":
            raise ValueError(f"unknown backend {self.backend!r} (available: llama.cpp)")
        if self.parallel < 1:
            raise ValueError("parallel must be >= 1")
        if self.n_ctx < 16:
            raise ValueError("n_ctx must be >= 16")


@dataclass
class QueueConfig:
    max_waiting: int = 16  # requests waiting for a slot; beyond it, 429 + Retry-After
    default_max_tokens: int = 512  # when a chat request names no max_tokens

    def __post_init__(self):
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")


@dataclass
class UpstreamConfig:
    url: str = ""  # the cloud tier (any OpenAI-compatible base URL); empty: edge only
    api_key: str = ""
    timeout_s: float = 60.0


@dataclass
class EdgeConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)

    @classmethod
    def load(cls, path=None, overrides=None, environ=None) -> EdgeConfig:
        return load_config(cls, "edge", path, overrides, environ)
