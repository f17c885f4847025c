"""The workers' internal HTTP API (gateway -> decode worker -> prefill worker): pydantic models
sent and parsed as JSON with ``model_dump_json`` / ``model_validate_json`` (never ``dict``s).

    POST /internal/generate  GenerateRequest -> NDJSON generation events (cascade.generation)
    POST /internal/prefill   PrefillRequest  -> PrefillResponse (after the KV transfer is acked)
    GET  /internal/load      -> WorkerLoadReport
    GET  /internal/tokenizer -> ServedModel (the model's names and its tokenizer, as files)
"""

from __future__ import annotations

import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from cloud_tier.disagg.messages import RequestRecord

Transport = Literal["tcp", "shm"]

_HOST_PORT = re.compile(r"^[A-Za-z0-9.\-]+:\d{1,5}$|^\[[0-9A-Fa-f:.]+\]:\d{1,5}$")


def _worker_url(v: str) -> str:
    """A worker's base URL: http(s), a host, printable ASCII (what the HTTP client will take)."""
    parts = urlsplit(v) if v.isascii() and v.isprintable() else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL of a worker: {v[:80]!r}")
    return v


def _host_port(v: str) -> str:
    if not _HOST_PORT.match(v) or not 0 < int(v.rsplit(":", 1)[1]) < 65536:
        raise ValueError(f"not a host:port address: {v[:80]!r}")
    return v


WorkerURL = Annotated[str, AfterValidator(_worker_url)]
HostPort = Annotated[str, AfterValidator(_host_port)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64", val_json_bytes="base64",
                              ser_json_inf_nan="constants")


class GenerateRequest(_Body):
    """Run ``record`` here: prefilled by ``prefill_url`` (disaggregated) or locally (None)."""

    record: RequestRecord
    prefill_url: WorkerURL | None = None
    transport: Transport = "tcp"


class PrefillRequest(_Body):
    record: RequestRecord
    kv_target: HostPort  # host:port of the decode worker's KV receiver
    transport: Transport = "tcp"


class PrefillResponse(_Body):
    request_id: str
    ok: bool
    code: str = ""  # "" | the ack's code | "transfer_failed" | "engine_error"
    message: str = ""
    record: RequestRecord | None = None  # with the first token; finish_reason set if it ended there
    text: str = ""  # the released text, when it ended on the prefill worker
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    nbytes: int = 0


class WorkerLoadReport(_Body):
    role: str
    model: str
    max_model_len: int
    block_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    waiting: int
    running: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_address: str | None = None


class ServedModel(_Body):
    """What a gateway needs of the model its workers serve, without the model itself."""

    model: str  # the id clients use
    aliases: list[str]  # other names accepted for it
    max_model_len: int
    tokenizer_files: dict[str, str]  # cloud_tier.tokenizer_files.dump
    # LLMEngine.model_identity: the model, its dtype and its KV layout (block size, KV dtype, layers,
    # KV heads, head size). Workers whose identities differ cannot exchange KV ("" if not told).
    model_identity: str = ""
    # model_distribution.artifacts.tokenizer_identity of its tokenizer: a device whose model has the
    # same may send its draft tokens to verify (cascade.draft); "" if not told (no drafts)
    tokenizer_identity: str = Field(default="", max_length=128)
    vocab_size: int = Field(default=0, ge=0, le=1 << 24)  # ids the model can produce (past the tokenizer)
    # cascade.embedding_identity of its embeddings (the weights' sha256, pooling, normalisation): the
    # gateway's card states it, so a device embeds in the cloud only with the same model ("" if not told)
    embedding_identity: str = Field(default="", max_length=256)
