"""The worker's own internal schemas (those shared with the gateway live in
``cloud_tier.disagg.protocol``).

    GET /internal/stats -> WorkerStats: what a worker holds right now, for tests and operators
    to see that nothing outlives its request.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineStats(_Body):
    """The engine between two steps. Idle means running == waiting == held == 0 and
    kv_blocks_free == kv_blocks_total (prefix-cached blocks count as free)."""

    running: int
    waiting: int
    held: int  # requests prefilled for a decode worker whose blocks are not released yet
    kv_blocks_free: int
    kv_blocks_total: int


class PrefillStats(_Body):
    in_flight: int  # /internal/prefill calls being served
    transfers_ok: int
    transfers_failed: int
    cancelled: int  # calls whose caller went away before the answer


class DecodeStats(_Body):
    pending: int  # requests waiting for their prefill and KV
    adopted: int
    rejected: int
    cancelled: int  # requests whose caller went away before their first output
    transfers_expected: int  # KV transfers the receiver will take (a request id and its token)
    transfers_receiving: int  # KV transfers being received or handled now
    receiving_bytes: int  # tcp payload bytes held for them


class WorkerStats(_Body):
    role: str
    engine: EngineStats
    prefill: PrefillStats | None = None  # roles prefill and both
    decode: DecodeStats | None = None  # roles decode and both
