"""What the pool's workers serve, asked of them at the gateway's start: our workers' model (its
names and tokenizer: the gateway never holds the model, nor torch) or the model names foreign
workers list; and, with k8s discovery, the wait for a first worker."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from cloud_tier.disagg.protocol import ServedModel
from cloud_tier.gateway.workers.pool import WorkerPool

log = logging.getLogger(__name__)


async def served_model(pool: WorkerPool, timeout_s: float) -> ServedModel:
    """The model's names and tokenizer, from the first worker that gives them."""
    deadline = time.monotonic() + timeout_s
    last_error = "no worker answered"
    while True:
        for w in pool.workers.values():
            try:
                r = await pool.client.get(f"{w.url}/internal/tokenizer", headers=pool.headers, timeout=60.0)
                r.raise_for_status()
                return ServedModel.model_validate_json(r.content)
            except (httpx.HTTPError, ValueError) as e:
                last_error = f"{w.url}: {e!r}"
        if time.monotonic() >= deadline:
            raise RuntimeError(f"no worker gave the model's tokenizer in {timeout_s:.0f} s ({last_error})")
        log.info("waiting for a worker to give the model's tokenizer (%s)", last_error)
        await asyncio.sleep(2.0)


async def foreign_models(pool: WorkerPool, timeout_s: float) -> tuple[list[str], int | None]:
    """The model names OpenAI-compatible workers serve (their /v1/models, all of them) and the
    shortest max_model_len they state (vLLM does), waiting for at least one to answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        names: list[str] = []
        lens: list[int] = []
        last_error = "no worker answered"
        for w in pool.workers.values():
            try:
                r = await pool.client.get(f"{w.url}/v1/models", headers=pool.headers, timeout=10.0)
                r.raise_for_status()
                for card in r.json().get("data") or ():
                    if isinstance(card, dict) and isinstance(card.get("id"), str):
                        names.append(card["id"]) if card["id"] not in names else None
                        n = card.get("max_model_len")
                        if isinstance(n, int) and n > 0:
                            lens.append(n)
            except (httpx.HTTPError, ValueError, AttributeError) as e:
                last_error = f"{w.url}: {e!r}"
        if names:
            return names, min(lens) if lens else None
        if time.monotonic() >= deadline:
            raise RuntimeError(f"no worker listed its models in {timeout_s:.0f} s ({last_error})")
        log.info("waiting for a worker to list its models (%s)", last_error)
        await asyncio.sleep(2.0)


async def first_worker(pool: WorkerPool, timeout_s: float) -> None:
    """Until discovery has found a worker (its kind decides how the gateway talks to the pool)."""
    deadline = time.monotonic() + timeout_s
    while not pool.workers:
        if time.monotonic() >= deadline:
            raise RuntimeError(f"k8s discovery found no ready worker pod in {timeout_s:.0f} s")
        await asyncio.sleep(1.0)
