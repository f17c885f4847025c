"""The gateway's ``POST /v1/embeddings``: the tenant's key and quota as for a generation (charged the
prompt tokens the worker reports), then the body as it came to one healthy worker's /v1/embeddings:
any of ours (each runs the whole model) or a foreign one (vLLM, SGLang: passed through unchanged).
No result cache: an embedding is cheap next to a generation, and equal bodies are rare."""

from __future__ import annotations

import random
import time

import httpx

from cascade import errors, wire
from cascade.embeddings import EmbeddingRequest
from cascade.web import parse_body
from cloud_tier.gateway.pipeline.flight import Flight
from cloud_tier.gateway.pipeline.settlement import outcome_of
from cloud_tier.gateway.pipeline.state import Quota
from cloud_tier.gateway.tenants.keys import ApiKey
from cloud_tier.gateway.tenants.quotas import Limits

RETRIED = (502, 503, 504)  # a worker that cannot answer now: the next one is asked (embedding twice is harmless)


def predicted_tokens(req: EmbeddingRequest) -> int:
    """What the quota is asked for before the worker counts: token inputs exactly, text at about four
    bytes a token (the worker's count settles it)."""
    return sum(len(x) if isinstance(x, list) else len(x.encode()) // 4 + 1 for x in req.inputs())


async def serve(svc, key: ApiKey, body: dict) -> tuple[int, dict]:
    """(status, JSON body) of one embedding request from ``key``; APIError when it is refused here."""
    try:
        req = parse_body(EmbeddingRequest, body)
        svc.check_model(req.model)
        predicted = predicted_tokens(req)
        await svc._check_quota(Flight(key.tenant, key, "embeddings", time.perf_counter()), predicted)  # noqa: SLF001
    except errors.APIError as e:
        svc.count(key.tenant, "embeddings", outcome_of(e))
        raise
    status, answer, used = 503, None, 0
    try:
        status, answer = await _ask_workers(svc, body)
        if status == 200:
            used = _prompt_tokens(answer)
        return status, answer
    finally:
        await svc.state.reconcile(Quota(key.tenant, key.key_id, Limits(), Limits()), predicted, used)
        svc.count(key.tenant, "embeddings", "ok" if status == 200 else f"{status // 100}xx")


async def _ask_workers(svc, body: dict) -> tuple[int, dict]:
    pool = svc.pool
    workers = [w for w in pool.workers.values() if w.available() and w.is_foreign == pool.foreign]
    random.shuffle(workers)
    last: errors.APIError = errors.APIError(503, "No healthy worker serves embeddings now.", "server_error", None,
                                            "no_workers", {"Retry-After": "1"})
    for w in workers:
        try:
            status, answer = await _post(pool.client, f"{w.url}/v1/embeddings", body, pool.headers,
                                         svc.config.worker_max_body_bytes, svc.config.request_timeout_s)
        except httpx.HTTPError as e:
            last = errors.APIError(502, f"A worker could not be reached: {e}", "server_error", None, "worker_error")
            continue
        if status in RETRIED:
            last = errors.APIError(status, f"A worker answered {status}.", "server_error", None, "worker_error")
            continue
        return status, answer
    raise last


async def _post(client: httpx.AsyncClient, url: str, body: dict, headers: dict, limit: int,
                timeout_s: float) -> tuple[int, dict]:
    """POST ``body``; (status, the answer's JSON object), read up to ``limit`` bytes (a 502 past it)."""
    async with client.stream("POST", url, json=body, headers={**headers, "accept": "application/json"},
                             timeout=timeout_s) as r:
        data = bytearray()
        async for chunk in r.aiter_bytes():
            data += chunk
            if len(data) > limit:
                raise httpx.DecodingError(f"the answer exceeds {limit} bytes")
    try:
        answer = wire.loads(bytes(data), limit=limit)
    except wire.WireError as e:
        raise httpx.DecodingError(f"the answer is not JSON ({e})") from e
    if not isinstance(answer, dict):
        raise httpx.DecodingError("the answer is not a JSON object")
    return r.status_code, answer


def _prompt_tokens(answer: dict) -> int:
    usage = answer.get("usage")
    n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 40 else 0
