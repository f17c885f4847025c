"""Asking both tiers for calibration: which model each serves, then every prompt of the set
answered by the edge (locally, ``cascade.mode = local``) and by the cloud, scored against each other."""

from __future__ import annotations

import asyncio

import httpx

from cascade.eval.calibration import Sample
from cascade.eval.scoring import Task
from cascade.policy.backpressure import parse_retry_after
from cascade.wire import WireError, loads

MAX_ANSWER_BYTES = 8 << 20  # an answer of either tier, decoded strictly


class Unreachable(RuntimeError):
    """A tier calibration needs did not answer: the message says which, at what URL, and how to start it."""


def _v1(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1") + "/v1"


def served_model(url: str, headers: dict, what: str, start: str) -> str:
    """The first model ``GET /v1/models`` at ``url`` lists; Unreachable naming ``what`` and how to
    ``start`` it when nothing (or not an OpenAI server) answers there."""
    models = f"{_v1(url)}/models"
    try:
        r = httpx.get(models, timeout=10, headers=headers)
    except httpx.HTTPError as e:
        raise Unreachable(f"cannot reach {what} at {models} ({type(e).__name__}: {e}); {start}") from e
    if r.status_code in (401, 403):
        raise Unreachable(f"{what} at {models} refused the key (HTTP {r.status_code}): pass --api-key or set "
                          "[upstream] api_key")
    if not r.is_success:
        raise Unreachable(f"{what} at {models} answered HTTP {r.status_code}: {r.text[:200]}")
    try:
        return loads(r.content, limit=MAX_ANSWER_BYTES)["data"][0]["id"]
    except (WireError, KeyError, IndexError, TypeError) as e:
        raise Unreachable(f"{what} at {models} did not answer an OpenAI model list ({e!r}); is that its URL?") from e



def edge_sha256(url: str, wait_s: float = 60.0) -> str:
    """The edge agent's served GGUF sha256 from its ``/healthz?sha256=1`` (which starts the hash in
    the background; asked again until it is done); "" when the agent does not tell it (an older
    agent, an ONNX model)."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            health = loads(httpx.get(f"{url.rstrip('/').removesuffix('/v1')}/healthz", params={"sha256": "1"},
                                     timeout=10).content, limit=MAX_ANSWER_BYTES)
        except (httpx.HTTPError, WireError):
            return ""
        if not isinstance(health, dict) or "model_sha256" not in health:
            return ""
        digest = health["model_sha256"]
        if isinstance(digest, str):
            return digest
        if time.monotonic() > deadline:
            return ""
        time.sleep(0.5)


async def _ask(client: httpx.AsyncClient, url: str, headers: dict, prompt: str, max_tokens: int,
               extra: dict | None = None) -> dict:
    body = {"model": extra.pop("model") if extra and "model" in extra else "default",
            "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            **(extra or {})}
    for attempt in range(5):
        r = await client.post(f"{_v1(url)}/chat/completions", json=body, headers=headers)
        if r.status_code == 429 and attempt < 4:
            await asyncio.sleep(parse_retry_after(r.headers.get("retry-after"), limit_s=60.0) or 1.0)
            continue
        r.raise_for_status()
        return loads(r.content, limit=MAX_ANSWER_BYTES)
    raise RuntimeError("unreachable")


async def collect(tasks: list[Task], edge_url: str, edge_model: str, cloud_url: str, cloud_model: str,
                  cloud_key: str, max_tokens: int = 0, concurrency: int = 4, progress=None) -> list[Sample]:
    """Every task answered by both tiers (greedy) and scored; ``max_tokens`` 0: each task's own
    length (``Task.max_tokens``: a code problem needs a function's worth)."""
    samples = [Sample(t) for t in tasks]
    gate = asyncio.Semaphore(concurrency)
    cloud_headers = {"authorization": f"Bearer {cloud_key}"} if cloud_key else {}
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(s: Sample) -> None:
            async with gate:
                n = max_tokens or s.task.max_tokens
                edge = await _ask(client, edge_url, {}, s.task.prompt, n,
                                  {"model": edge_model, "cascade": {"mode": "local"}})
                cloud = await _ask(client, cloud_url, cloud_headers, s.task.prompt, n, {"model": cloud_model})
            s.edge_text = edge["choices"][0]["message"]["content"]
            s.confidence = (edge.get("cascade") or {}).get("confidence")
            s.cloud_text = cloud["choices"][0]["message"]["content"]
            # a code answer is graded in a child process: off the event loop
            s.edge_score = await asyncio.to_thread(s.task.score, s.edge_text, s.cloud_text)
            s.cloud_score = await asyncio.to_thread(s.task.score, s.cloud_text, s.cloud_text)
            if progress:
                progress()
        await asyncio.gather(*(one(s) for s in samples))
    return samples
