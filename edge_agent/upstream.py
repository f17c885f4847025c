"""The edge agent's client of the cloud tier (any OpenAI-compatible URL): pooled httpx, time
limits, the device key, one Idempotency-Key per escalation, retries only where they cannot run
a request twice, and SSE read chunk by chunk (nothing buffered whole). It owns the
back-pressure circuit: a 429 or an unreachable cloud opens it; a success closes it."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from cascade.generation import Finish, TokenEvent, TopToken
from cascade.policy.backpressure import CircuitBreaker, parse_retry_after
from edge_agent.config import UpstreamConfig
from sync.delivery import Outcome
from sync.queue import Item

log = logging.getLogger(__name__)

ENDPOINTS = {"chat": "/chat/completions", "completions": "/completions"}


class UpstreamUnavailable(Exception):
    """The cloud could not take the request (unreachable, 429, 5xx): serve it another way."""

    def __init__(self, message: str, status: int | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass
class Escalation:
    """An escalation's stream: the cloud's model name and its answer as generation events."""

    model: str
    events: AsyncIterator[TokenEvent | Finish]
    idempotency_key: str


class Upstream:
    def __init__(self, config: UpstreamConfig, device: str = "", session_header: str | None = None):
        base = config.url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else f"{base}/v1"
        self.config = config
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        if config.api_key:
            headers["authorization"] = f"Bearer {config.api_key}"
        if device:
            headers["x-cascade-device"] = device
        self.client = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(config.timeout_s, connect=min(5.0, config.timeout_s)),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))
        self.breaker = CircuitBreaker(max_backoff_s=config.max_backoff_s)
        self._cloud_model: str | None = None

    async def close(self) -> None:
        await self.client.aclose()

    @property
    def available(self) -> bool:
        """Whether the circuit lets a request through now (closed, or half-open for a probe)."""
        return self.breaker.state != "open" and not self.breaker.probing

    async def escalate(self, endpoint: str, body: dict, reason: str, draft: str | None = None,
                       session: str | None = None, retries: int = 1) -> Escalation:
        """Start the request on the cloud, streamed; returns once its first chunk arrived (so a
        refusal is known before anything is sent to the app). UpstreamUnavailable otherwise."""
        if not self.breaker.allow():
            raise UpstreamUnavailable(f"the cloud is backing off ({self.breaker.last_error})",
                                      retry_after_s=self.breaker.retry_after_s())
        key = uuid.uuid4().hex
        headers = {"idempotency-key": key, "x-cascade-reason": reason}
        if session:
            headers["x-cascade-session"] = session
        if draft:
            headers["x-cascade-draft"] = json.dumps(draft[:2000])
        payload = {k: v for k, v in body.items() if k != "cascade"}
        payload["model"] = await self._model() or payload.get("model")
        payload["stream"] = True
        payload["stream_options"] = {"include_usage": True}
        for attempt in range(retries + 1):
            try:
                return await self._open(endpoint, payload, headers, key)
            except httpx.HTTPError as e:
                # nothing has reached the app yet, and the Idempotency-Key makes the cloud run
                # the request once however often it is sent: a retry is safe here
                if attempt < retries:
                    await asyncio.sleep(0.2 * (attempt + 1))
                    continue
                self.breaker.failure(f"unreachable: {e!r}")
                raise UpstreamUnavailable(f"the cloud is unreachable: {e!r}") from e
        raise AssertionError("unreachable")

    async def deliver(self, item: Item) -> Outcome:
        """Send one queued request, not streamed, under its own id as the Idempotency-Key (so a
        resend after a crash or a lost response is answered from the cloud's stored result)."""
        headers = {"idempotency-key": item.id, "x-cascade-reason": item.reason or "queued",
                   "accept": "application/json"}
        if item.session:
            headers["x-cascade-session"] = item.session
        payload = dict(item.payload)  # stored without the cascade and stream fields (Outbox.submit)
        payload["model"] = await self._model() or payload.get("model")
        try:
            r = await self.client.post(self.base_url + ENDPOINTS[item.endpoint], json=payload, headers=headers)
        except httpx.HTTPError as e:
            return Outcome(0, error=f"unreachable: {e!r}")
        try:
            body = r.json()
        except ValueError:
            body = {"error": {"message": r.text[:500], "type": "upstream_error"}}
        return Outcome(r.status_code, body, _retry_after(r.headers.get("retry-after")),
                       "" if r.is_success else f"HTTP {r.status_code}: {r.text[:200]}")

    async def probe(self) -> bool:
        """A cheap check that the cloud answers (and takes this agent's key): GET /v1/models."""
        try:
            r = await self.client.get(self.base_url + "/models", timeout=5.0)
        except httpx.HTTPError:
            return False
        if r.is_success and not self.config.model and self._cloud_model is None:
            try:
                self._cloud_model = r.json()["data"][0]["id"]
            except (ValueError, KeyError, IndexError):
                pass
        return r.is_success

    async def _model(self) -> str | None:
        """The model to ask for: ``[upstream] model``, else the cloud's first (asked once)."""
        if self.config.model:
            return self.config.model
        if self._cloud_model is None:
            try:
                r = await self.client.get(self.base_url + "/models")
                r.raise_for_status()
                self._cloud_model = r.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                log.warning("cannot list the cloud's models (%s); asking for the app's model name", e)
                return None
        return self._cloud_model

    async def _open(self, endpoint: str, payload: dict, headers: dict, key: str) -> Escalation:
        req = self.client.build_request("POST", self.base_url + ENDPOINTS[endpoint], json=payload, headers=headers)
        resp = await self.client.send(req, stream=True)
        if resp.status_code != 200:
            text = (await resp.aread()).decode("utf-8", "replace")[:500]
            await resp.aclose()
            retry_after = _retry_after(resp.headers.get("retry-after"))
            if resp.status_code in (401, 403, 404) or resp.status_code == 429 or resp.status_code >= 500:
                # 429/5xx: the cloud is busy or down; 401/403/404: this agent's upstream key or
                # model is misconfigured, not the app's request: either way, serve it another way
                if resp.status_code in (401, 403, 404):
                    log.error("the cloud refused this agent (%d): check [upstream] api_key and model: %s",
                              resp.status_code, text[:200])
                self.breaker.failure(f"HTTP {resp.status_code}", retry_after)
                raise UpstreamUnavailable(f"the cloud answered {resp.status_code}: {text}", resp.status_code,
                                          retry_after)
            self.breaker.success()  # it is up; the request itself was refused
            raise UpstreamRefused(resp.status_code, text)
        lines = resp.aiter_lines()
        try:
            first = await _next_chunk(lines)
        except BaseException:
            await resp.aclose()
            raise
        self.breaker.success()
        return Escalation(first.get("model", "") if first else "", _events(resp, lines, first, endpoint), key)


class UpstreamRefused(Exception):
    """The cloud rejected the request itself (4xx other than 429): pass it on to the app."""

    def __init__(self, status: int, body: str):
        super().__init__(body)
        self.status = status
        self.body = body


def _retry_after(value: str | None) -> float | None:
    return parse_retry_after(value)


async def _next_chunk(lines: AsyncIterator[str]) -> dict | None:
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return None
        chunk = json.loads(data)
        if "error" in chunk:
            raise httpx.RemoteProtocolError(chunk["error"].get("message", "upstream error"))
        return chunk
    return None


async def _events(resp: httpx.Response, lines: AsyncIterator[str], first: dict | None,
                  endpoint: str) -> AsyncIterator[TokenEvent | Finish]:
    """OpenAI chunks -> generation events: one TokenEvent per chunk with text, then a Finish."""
    finish_reason, usage = "stop", None
    try:
        chunk = first
        while chunk is not None:
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if endpoint == "chat" else choice.get("text")
                lp = ((choice.get("logprobs") or {}).get("content") or [None])[0] if endpoint == "chat" else None
                if text:
                    yield TokenEvent(-1, text, text.encode(), float(lp["logprob"]) if lp else 0.0, 0.0,
                                     tuple(TopToken(-1, t["token"], float(t["logprob"]), t["token"].encode())
                                           for t in (lp or {}).get("top_logprobs") or []))
                if choice.get("finish_reason"):
                    finish_reason = choice["finish_reason"]
            chunk = await _next_chunk(lines)
        usage = usage or {}
        yield Finish(finish_reason, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))
    finally:
        await resp.aclose()
