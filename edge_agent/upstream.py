"""The edge agent's client of the cloud tier (any OpenAI-compatible URL): pooled httpx, time
limits, the device key, one Idempotency-Key per escalation, retries only where they cannot run
a request twice, and SSE read chunk by chunk (nothing buffered whole). It owns the
back-pressure circuit: a 429 or an unreachable cloud opens it; a success closes it."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from cascade import errors, sse
from cascade.generation import Finish, TokenEvent, TopToken
from cascade.policy.backpressure import CircuitBreaker, parse_retry_after
from cascade.structured.tools import StreamedCalls
from edge_agent.config import UpstreamConfig
from edge_agent.drafts import draft_counts, tokenizers_of
from edge_agent.upstream_reads import MAX_ERROR_BODY, _content_type, _is_error_body, _json_object, _read_at_most
from sync.delivery import Outcome
from sync.queue import Item

log = logging.getLogger(__name__)

ENDPOINTS = {"chat": "/chat/completions", "completions": "/completions"}


FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter", "function_call", "cancelled")


class UpstreamUnavailable(Exception):
    """The cloud could not take the request (unreachable, 429, 5xx, or it refused this device:
    ``refused``): serve it another way."""

    def __init__(self, message: str, status: int | None = None, retry_after_s: float | None = None,
                 refused: bool = False):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.refused = refused


class UpstreamFailedRequest(UpstreamUnavailable):
    """The cloud is up and failed this request (a 5xx with an OpenAI error body, other than
    502/503/504): serve it another way, and the circuit stays closed for every other request
    (one poison prompt must not take the cloud away from the whole device)."""


class UpstreamRefused(Exception):
    """The cloud rejected the request itself (4xx other than 429): pass it on to the app."""

    def __init__(self, status: int, body: str):
        super().__init__(body)
        self.status = status
        self.body = body


class UpstreamBroken(Exception):
    """The cloud's answer was not an OpenAI answer: HTML from a captive portal, a body that is
    not a completion, a stream cut short or with an unreadable chunk."""


@dataclass
class Escalation:
    """An escalation's stream: the cloud's model name and its answer as generation events."""

    model: str
    events: AsyncIterator[TokenEvent | Finish]
    idempotency_key: str


def idempotency_key(device: str, app_key: str | None) -> str:
    """The key the cloud sees for a request: one derived from the app's own Idempotency-Key
    (so a retry of it, live or queued, runs once on the cloud), else a fresh one."""
    if app_key is None:
        return uuid.uuid4().hex
    return "app-" + hashlib.sha256(f"{device}\0{app_key}".encode()).hexdigest()[:32]


TOKENIZER_RELIST_S = 60.0  # an unknown model's tokenizer is asked for at most this often
REFUSAL = {401, 403}  # the cloud refuses this device: its key is wrong or revoked


class Upstream:
    def __init__(self, config: UpstreamConfig, device: str = "", session_header: str | None = None):
        base = config.url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else f"{base}/v1"
        self.config = config
        self.device = device
        # escalations run in the cloud's escalation class: after interactive traffic, ahead of batch jobs
        headers = {"content-type": "application/json", "accept": "text/event-stream",
                   "x-cascade-priority": "escalation"}
        if config.api_key:
            headers["authorization"] = f"Bearer {config.api_key}"
        if device:
            headers["x-cascade-device"] = device
        self.client = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(config.timeout_s, connect=min(5.0, config.timeout_s)),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))
        self.breaker = CircuitBreaker(max_backoff_s=config.max_backoff_s, refused_backoff_s=config.refused_backoff_s,
                                      max_retry_after_s=config.max_retry_after_s)
        self._cloud_model: str | None = None
        self._tokenizers: dict[str, str] = {}  # the cloud's models -> their tokenizer identity (meta.tokenizer)
        self._listed_at = -math.inf  # when the cloud's model list was last read
        self.max_event_bytes = sse.MAX_EVENT_BYTES  # one line of the cloud's stream, bounded while read

    async def close(self) -> None:
        await self.client.aclose()

    @property
    def available(self) -> bool:
        """Whether the circuit lets a request through now (closed, or half-open for a probe)."""
        return self.breaker.available

    @property
    def refused(self) -> bool:
        """The cloud's last word was that it refuses this device (401/403)."""
        return self.breaker.refused and self.breaker.failures > 0

    def note_refusal(self, status: int, text: str, retry_after_s: float | None = None) -> None:
        """The cloud refused this device: its own breaker state, logged once when it starts."""
        if not self.refused:
            log.error("the cloud refuses this device (HTTP %d): check [upstream] api_key; asking again "
                      "on a slow schedule: %s", status, text[:200])
        self.breaker.refusal(f"refused: HTTP {status} (check [upstream] api_key)", retry_after_s)

    async def escalate(self, endpoint: str, body: dict, reason: str, draft: dict | None = None,
                       session: str | None = None, retries: int = 1, app_key: str | None = None) -> Escalation:
        """Start the request on the cloud, streamed; returns once its first chunk arrived (so a
        refusal is known before anything is sent to the app). UpstreamUnavailable otherwise.
        ``draft``: the device's tokens so far (``cascade.draft``: ``draft_of``), sent only to a cloud
        model whose tokenizer identity is the draft's (its /v1/models card says so).
        Every exit settles the breaker: a success, a failure, a refusal of this device, or (when
        cancelled) the probe slot given back."""
        if not self.breaker.allow():
            raise UpstreamUnavailable(f"the cloud is backing off ({self.breaker.last_error})",
                                      retry_after_s=self.breaker.retry_after_s(), refused=self.refused)
        key = idempotency_key(self.device, app_key)
        log.debug("escalating %s to %s (reason %s, idempotency key %s)", endpoint, self.base_url, reason, key)
        headers = {"idempotency-key": key, "x-cascade-reason": reason}
        if session:
            headers["x-cascade-session"] = session
        try:
            payload = {k: v for k, v in body.items() if k != "cascade"}
            payload["model"] = await self._model() or payload.get("model")
            if draft and await self._tokenizer(payload["model"]) == draft["tokenizer"]:
                payload["cascade"] = {"draft": draft}
            payload["stream"] = True
            payload["stream_options"] = {"include_usage": True}
            for attempt in range(retries + 1):
                try:
                    esc = await self._open(endpoint, payload, headers, key)
                except httpx.HTTPError as e:
                    # nothing has reached the app yet, and the Idempotency-Key makes the cloud run
                    # the request once however often it is sent: a retry is safe here
                    if attempt < retries:
                        await asyncio.sleep(0.2 * (attempt + 1))
                        continue
                    raise UpstreamUnavailable(f"the cloud is unreachable: {e!r}") from e
                self.breaker.success()
                return esc
        except (UpstreamRefused, UpstreamFailedRequest):
            self.breaker.success()  # it is up; the request itself was refused or failed
            raise
        except UpstreamUnavailable as e:
            if e.refused:
                self.note_refusal(e.status or 401, str(e), e.retry_after_s)
            else:
                self.breaker.failure(str(e)[:300], e.retry_after_s)
            raise
        except UpstreamBroken as e:
            self.breaker.failure(f"broken answer: {e}")
            raise UpstreamUnavailable(f"the cloud's answer was not usable: {e}") from e
        except Exception as e:  # our own failure to send: nothing says the cloud is down or up
            self.breaker.abandon()
            raise UpstreamUnavailable(f"the request could not be sent: {e!r}") from e
        except BaseException:  # cancelled: the probe slot goes back, nothing learnt
            self.breaker.abandon()
            raise
        raise AssertionError("unreachable")

    async def deliver(self, item: Item) -> Outcome:
        """Send one queued request, not streamed, under its own id as the Idempotency-Key (so a
        resend after a crash or a lost response is answered from the cloud's stored result), or
        under the key derived from the app's own key when it gave one. Only a JSON completion
        counts as delivered: any other 2xx (a captive portal's HTML) is tried again."""
        key = idempotency_key(self.device, item.app_key) if item.app_key else item.id
        headers = {"idempotency-key": key, "x-cascade-reason": item.reason or "queued",
                   "accept": "application/json"}
        if item.session:
            headers["x-cascade-session"] = item.session
        payload = dict(item.payload)  # stored without the cascade and stream fields (Outbox.submit)
        payload["model"] = await self._model() or payload.get("model")
        try:
            r = await self.client.post(self.base_url + ENDPOINTS[item.endpoint], json=payload, headers=headers)
        except httpx.HTTPError as e:
            return Outcome(0, error=f"unreachable: {e!r}")
        retry_after = parse_retry_after(r.headers.get("retry-after"))
        if r.status_code in REFUSAL:  # the delivery loop puts the breaker in its refused state
            return Outcome(r.status_code, None, retry_after,
                           f"refused: HTTP {r.status_code} (the cloud refuses this device's key; "
                           f"check [upstream] api_key): {r.text[:200]}")
        if r.is_success:
            body = _json_object(r)
            if body is None or not isinstance(body.get("choices"), list):
                return Outcome(502, None, retry_after,
                               f"HTTP {r.status_code} but not a completion ({_content_type(r)}): {r.text[:200]}")
            return Outcome(r.status_code, body, retry_after)
        body = _json_object(r) or {"error": {"message": r.text[:500], "type": "upstream_error"}}
        return Outcome(r.status_code, body, retry_after, f"HTTP {r.status_code}: {r.text[:200]}")

    async def probe(self) -> Outcome:
        """A cheap check that the cloud answers, and takes this agent's key: GET /v1/models must
        answer an OpenAI model list (a captive portal's 200 is not the cloud)."""
        try:
            r = await self.client.get(self.base_url + "/models", timeout=5.0)
        except httpx.HTTPError as e:
            return Outcome(0, error=f"unreachable: {e!r}")
        if r.status_code in REFUSAL:
            return Outcome(r.status_code, None, None, f"refused: HTTP {r.status_code} (check [upstream] api_key)")
        if not r.is_success:
            return Outcome(r.status_code, None, parse_retry_after(r.headers.get("retry-after")),
                           f"probe: HTTP {r.status_code}")
        listing = _json_object(r)
        models = _model_ids(listing)
        self._note_tokenizers(listing)
        if models is None:
            return Outcome(502, None, None, f"probe: HTTP {r.status_code} but not a model list ({_content_type(r)})")
        if not self.config.model and self._cloud_model is None and models:
            self._cloud_model = models[0]
        return Outcome(r.status_code, {"models": models})

    async def _model(self) -> str | None:
        """The model to ask for: ``[upstream] model``, else the cloud's first (asked once)."""
        if self.config.model:
            return self.config.model
        if self._cloud_model is None:
            try:
                r = await self.client.get(self.base_url + "/models")
                r.raise_for_status()
                listing = _json_object(r)
                models = _model_ids(listing)
                self._note_tokenizers(listing)
                if not models:
                    raise ValueError(f"not a model list ({_content_type(r)})")
                self._cloud_model = models[0]
            except (httpx.HTTPError, ValueError) as e:
                log.warning("cannot list the cloud's models (%s); asking for the app's model name", e)
                return None
        return self._cloud_model

    async def _tokenizer(self, model: str | None) -> str:
        """The tokenizer identity the cloud states for ``model`` ("" when it states none): from its
        model list, read at most once a minute."""
        if model not in self._tokenizers and time.monotonic() - self._listed_at > TOKENIZER_RELIST_S:
            with contextlib.suppress(httpx.HTTPError):  # no list: no draft, nothing else changes
                self._note_tokenizers(_json_object(await self.client.get(self.base_url + "/models", timeout=5.0)))
        return self._tokenizers.get(model or "", "")

    def _note_tokenizers(self, listing: dict | None) -> None:
        self._listed_at = time.monotonic()
        self._tokenizers.update(tokenizers_of(listing))

    async def _open(self, endpoint: str, payload: dict, headers: dict, key: str) -> Escalation:
        req = self.client.build_request("POST", self.base_url + ENDPOINTS[endpoint], json=payload, headers=headers)
        resp = await self.client.send(req, stream=True)
        try:
            if resp.status_code != 200:
                full = await _read_at_most(resp, MAX_ERROR_BODY)
                text = full[:500]
                retry_after = parse_retry_after(resp.headers.get("retry-after"))
                if resp.status_code in REFUSAL:
                    raise UpstreamUnavailable(f"the cloud refused this device ({resp.status_code}): {text}",
                                              resp.status_code, retry_after, refused=True)
                if resp.status_code >= 500 and resp.status_code not in (502, 503, 504) and _is_error_body(full):
                    raise UpstreamFailedRequest(f"the cloud failed this request ({resp.status_code}): {text}",
                                                resp.status_code, retry_after)
                if resp.status_code in (404, 429) or resp.status_code >= 500 or resp.status_code < 400:
                    # 429/5xx: the cloud is busy or down; 404: this agent's model is not there;
                    # a 1xx-3xx is no answer: either way, serve it another way
                    if resp.status_code == 404:
                        log.error("the cloud has no such model (404): check [upstream] model: %s", text[:200])
                    raise UpstreamUnavailable(f"the cloud answered {resp.status_code}: {text}", resp.status_code,
                                              retry_after)
                raise UpstreamRefused(resp.status_code, text)
            if "text/event-stream" not in resp.headers.get("content-type", ""):
                text = (await resp.aread()).decode("utf-8", "replace")[:200]
                raise UpstreamBroken(f"HTTP 200 but not an event stream ({_content_type(resp)}): {text}")
            lines = sse.lines(resp.aiter_bytes(), self.max_event_bytes)
            first = await _next_chunk(lines, self.max_event_bytes)
            if first is None:
                raise UpstreamBroken("the stream ended before its first chunk")
        except BaseException:
            await resp.aclose()
            raise
        model = first.get("model")
        return Escalation(model if isinstance(model, str) else "",
                          _events(resp, lines, first, endpoint, self.max_event_bytes), key)


def _tokens(usage: dict, name: str) -> int:
    """A token count of the cloud's usage: an integer, clamped to 0..2**31-1 (0 when it is none)."""
    v = usage.get(name)
    return min(max(v, 0), 2**31 - 1) if isinstance(v, int) and not isinstance(v, bool) else 0


def _model_ids(body: dict | None) -> list[str] | None:
    """The ids of an OpenAI model list, or None when ``body`` is not one."""
    data = body.get("data") if body else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        return None
    return [m["id"] for m in data]


async def _next_chunk(lines: AsyncIterator[bytes], limit: int) -> dict | None:
    """The next chunk of an OpenAI stream; None at ``[DONE]``. UpstreamBroken for a stream that
    ends without ``[DONE]``, a chunk that is not a JSON object, a line over ``limit``, or an in-band error."""
    try:
        return await sse.next_chunk(lines, limit)
    except sse.BrokenStream as e:
        raise UpstreamBroken(str(e)) from None


async def _events(resp: httpx.Response, lines: AsyncIterator[bytes], first: dict,
                  endpoint: str, limit: int) -> AsyncIterator[TokenEvent | Finish]:
    """OpenAI chunks -> generation events: one TokenEvent per chunk with text, then a Finish.
    A stream that ends with neither ``[DONE]`` nor a finish reason, or breaks (an unreadable
    chunk, an in-band error), is no answer: a 502 (in-band once streaming), never a short "stop"."""
    finish_reason, usage, draft = None, None, (0, 0)
    calls = StreamedCalls()
    try:
        chunk = first
        while chunk is not None:
            if isinstance(chunk.get("usage"), dict):
                usage = chunk["usage"]
            if isinstance(chunk.get("cascade"), dict):
                draft = draft_counts(chunk["cascade"].get("draft")) or draft
            for choice in chunk.get("choices") or []:
                if endpoint == "chat":
                    calls.add((choice.get("delta") or {}).get("tool_calls"))
                text = (choice.get("delta") or {}).get("content") if endpoint == "chat" else choice.get("text")
                lp = ((choice.get("logprobs") or {}).get("content") or [None])[0] if endpoint == "chat" else None
                for markup in calls.take() if text else ():  # calls the cloud finished before this text
                    yield TokenEvent(-1, markup, markup.encode(), 0.0, 0.0)
                if text:
                    yield TokenEvent(-1, text, text.encode(), float(lp["logprob"]) if lp else 0.0, 0.0,
                                     tuple(TopToken(-1, t["token"], float(t["logprob"]), t["token"].encode())
                                           for t in (lp or {}).get("top_logprobs") or []))
                if choice.get("finish_reason"):
                    finish_reason = choice["finish_reason"]
                    if finish_reason not in FINISH_REASONS:
                        raise ValueError(f"an unknown finish_reason {str(finish_reason)[:40]!r}")
                    for markup in calls.take():  # the cloud's calls, as the model's markup the agent's formatter reads
                        yield TokenEvent(-1, markup, markup.encode(), 0.0, 0.0)
            try:
                chunk = await _next_chunk(lines, limit)
            except UpstreamBroken:
                if finish_reason is None:
                    raise
                chunk = None  # finished, only the end of the stream was lost
        for markup in calls.take():  # calls the stream ended without finishing
            yield TokenEvent(-1, markup, markup.encode(), 0.0, 0.0)
        usage = usage or {}
        yield Finish(finish_reason or "stop", _tokens(usage, "prompt_tokens"), _tokens(usage, "completion_tokens"),
                     draft_offered=draft[0], draft_accepted=draft[1])
    except (UpstreamBroken, httpx.HTTPError, AttributeError, TypeError, KeyError, ValueError) as e:
        log.warning("the cloud's stream broke: %r", e)
        raise errors.APIError(502, f"The cloud tier's answer broke off: {str(e) or repr(e)}", "server_error",
                              code="upstream_broken") from e
    finally:
        await resp.aclose()

