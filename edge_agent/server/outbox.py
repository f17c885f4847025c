"""The edge agent's side of store-and-forward: requests the cloud could not take are queued
(sync/queue.py) and answered ``202 Accepted``; the delivery loop (sync/delivery.py) sends them
through the upstream client when the cloud is back; the app reads the outcome at
``GET /v1/requests/{id}`` or is called back."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from cascade import errors
from cascade.config import cascade_home
from edge_agent.config import SyncConfig
from edge_agent.upstream import Upstream
from sync.delivery import DeliveryConfig, DeliveryLoop
from sync.group_commit import GroupCommit
from sync.queue import Item, KeyReused, Kind, NewItem, OfflineQueue, QueueFull, State

log = logging.getLogger(__name__)


def queue_path(config: SyncConfig) -> Path:
    return Path(config.path).expanduser() if config.path else cascade_home() / "edge" / "queue.db"


def open_queue(config: SyncConfig, lease_s: float = 120.0) -> OfflineQueue:
    return OfflineQueue(queue_path(config), max_items=config.max_items, max_bytes=config.max_bytes,
                        request_ttl_s=config.request_ttl_s, telemetry_ttl_s=config.telemetry_ttl_s,
                        keep_s=config.keep_s, lease_s=lease_s, synchronous=config.synchronous)


def _stored(body: dict) -> dict:
    """What of a request is queued: the body without our options and the streaming fields."""
    return {k: v for k, v in body.items() if k not in ("cascade", "stream", "stream_options")}


def describe(item: Item) -> dict:
    """An item as the app sees it at ``GET /v1/requests/{id}`` (and in a callback)."""
    out = {"id": item.id, "object": "cascade.request", "state": item.state, "kind": item.kind,
           "endpoint": item.endpoint, "session": item.session, "reason": item.reason,
           "created_at": round(item.created_at, 3), "updated_at": round(item.updated_at, 3),
           "expires_at": round(item.expires_at, 3), "attempts": item.attempts,
           "last_error": item.last_error or None}
    if item.state == State.DONE:
        out["response"] = item.result
    elif item.state == State.FAILED:
        out["status"] = item.result_status
        out["error"] = (item.result or {}).get("error", item.result) if isinstance(item.result, dict) else item.result
    return out


class Outbox:
    def __init__(self, config: SyncConfig, upstream: Upstream | None):
        self.config = config
        self.upstream = upstream
        lease_s = (upstream.config.timeout_s + 30.0) if upstream else 120.0
        self.queue = open_queue(config, lease_s)
        self._writer = GroupCommit(self.queue)
        self._callbacks = httpx.AsyncClient(timeout=10.0)
        self.loop: DeliveryLoop | None = None
        if upstream is not None:
            self.loop = DeliveryLoop(
                self.queue, upstream.deliver, upstream.probe, upstream.breaker,
                DeliveryConfig(batch_size=config.batch_size, base_backoff_s=config.base_backoff_s,
                               max_backoff_s=config.max_backoff_s, poll_s=config.poll_s, lease_s=lease_s,
                               max_attempts=config.max_attempts),
                callback=self._callback)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.loop is not None:
            self._task = asyncio.create_task(self.loop.run(), name="delivery")

    def use_upstream(self, upstream: Upstream) -> None:
        """A reload's new cloud client: the next delivery round sends through it (a round under
        way finishes on the old one). Only between two clients: with none, there is no loop."""
        self.upstream = upstream
        if self.loop is not None:
            self.loop.send, self.loop.probe, self.loop.breaker = upstream.deliver, upstream.probe, upstream.breaker
            self.loop.notify()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._callbacks.aclose()
        self.queue.close()

    def check_callback(self, url: str | None) -> None:
        if url is None:
            return
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise errors.bad_request("callback_url must be an http(s) URL.", "cascade.callback_url")
        hosts = self.config.callback_hosts
        if "*" not in hosts and parts.hostname not in hosts:
            raise errors.bad_request(f"callback_url must point at this device ({', '.join(hosts)}); "
                                     "see [sync] callback_hosts.", "cascade.callback_url")

    async def submit(self, endpoint: str, body: dict, reason: str, session: str | None, opts,
                     app_key: str | None = None) -> str:
        """Queue a request for the cloud; returns its id once the write is durable.
        503 ``offline_queue_full`` when there is no room for it. With the app's own
        ``Idempotency-Key`` (``app_key``) a retried POST gets the first one's id, not a second item."""
        callback = opts.callback_url if opts else None
        self.check_callback(callback)
        payload = _stored(body)
        item = NewItem(Kind.REQUEST, payload, endpoint=endpoint, session=session,
                       priority=opts.priority if opts else 0, ttl_s=opts.ttl_s if opts else None,
                       callback_url=callback, reason=reason, app_key=app_key)
        try:
            item_id = await self._writer.put(item)
        except KeyReused as e:
            raise errors.APIError(422, f"{e}.", "invalid_request_error", "Idempotency-Key",
                                  "idempotency_key_reused") from e
        except QueueFull as e:
            raise errors.APIError(503, f"The cloud cannot be reached and {e}; nothing was queued. Retry later.",
                                  "server_error", code="offline_queue_full", headers={"Retry-After": "30"}) from e
        if self.loop is not None:
            self.loop.notify()
        return item_id

    async def earlier(self, body: dict, app_key: str) -> Item | None:
        """The request queued under the app's ``Idempotency-Key`` ``app_key``, if any: a retry of
        it is answered with that item (whether the cloud is back or not), never sent again. 422
        when the key was used for a different request."""
        item = await asyncio.to_thread(self.queue.by_app_key, app_key)
        if item is None or item.kind != Kind.REQUEST:
            return None
        if item.payload != _stored(body):
            raise errors.APIError(422, f"the Idempotency-Key {app_key!r} was used for a different request.",
                                  "invalid_request_error", "Idempotency-Key", "idempotency_key_reused")
        return item

    async def spool_telemetry(self, record: dict) -> str | None:
        return await self._writer.put(NewItem(Kind.TELEMETRY, record, priority=-1))

    async def status(self, item_id: str) -> dict:
        item = await asyncio.to_thread(self.queue.get, item_id)
        if item is None or item.kind != Kind.REQUEST:
            raise errors.APIError(404, f"No queued request with id {item_id!r}.", "invalid_request_error",
                                  "id", "request_not_found")
        return describe(item)

    async def _callback(self, item: Item) -> bool:
        r = await self._callbacks.post(item.callback_url, json={**describe(item), "delivered_at": time.time()})
        return r.is_success
