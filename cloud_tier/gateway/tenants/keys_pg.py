"""API keys, tenant limits and budgets in PostgreSQL, shared by several gateway replicas: the key
store's semantics (``keys.KeyRecords``, one implementation) on ``sync.postgres.PgStore``.

Each replica caches what it verified. Every revocation and every change of a tenant's limits or
of a budget, whoever makes it (the command line, the admin API, another replica), sends a NOTIFY
on ``cascade_keys`` in its own transaction; each replica's ``listen()`` task, on a connection of
its own, drops what it cached of the change as the notification arrives. While it listens, a
cached entry is trusted for ``listened_ttl_s`` (a backstop: a notification is never the only
way a change arrives); while it does not (not started, or its connection broke), for
``cache_ttl_s`` (a lost connection cuts what is cached down to that), and on every (re)connection
the whole cache is dropped, since notifications may have been missed meanwhile. A payload it
cannot read is ignored and counted (``notifications_ignored``)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import psycopg

from cascade import wire
from cloud_tier.gateway.tenants.keys import KeyRecords
from sync.postgres import PgStore

log = logging.getLogger(__name__)

CHANNEL = "cascade_keys"

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS tenants (name text PRIMARY KEY, rps double precision NOT NULL, "
    "tpm double precision NOT NULL, created_at double precision NOT NULL)",
    "CREATE TABLE IF NOT EXISTS api_keys (key_id text PRIMARY KEY, key_hash text NOT NULL, "
    "tenant text NOT NULL REFERENCES tenants (name), device text, scopes text NOT NULL, "
    "rps double precision NOT NULL, tpm double precision NOT NULL, created_at double precision NOT NULL, "
    "revoked integer NOT NULL, priority integer NOT NULL DEFAULT 0)",
    "CREATE INDEX IF NOT EXISTS api_keys_tenant ON api_keys (tenant)",
    # the tenants' floors on service-level targets (a database from before them gets the columns)
    "ALTER TABLE tenants ADD COLUMN IF NOT EXISTS min_ttft_slo_s double precision NOT NULL DEFAULT 0",
    "ALTER TABLE tenants ADD COLUMN IF NOT EXISTS min_tpot_slo_s double precision NOT NULL DEFAULT 0",
    "CREATE TABLE IF NOT EXISTS budgets (scope text NOT NULL, name text NOT NULL, tokens double precision NOT NULL, "
    "usd double precision NOT NULL, period text NOT NULL, PRIMARY KEY (scope, name))",
    "CREATE TABLE IF NOT EXISTS spend (scope text NOT NULL, name text NOT NULL, period text NOT NULL, "
    "tokens double precision NOT NULL, usd double precision NOT NULL, PRIMARY KEY (scope, name, period))",
)


def parse_change(payload: str) -> dict:
    """The change a NOTIFY payload names, as ``KeyRecords.invalidate``'s keyword arguments; ValueError
    for anything else."""
    try:  # PostgreSQL's payloads are at most 8000 bytes; a name here is never a control character
        change = wire.loads(payload, limit=8000, text_safe=True)
    except wire.WireError as e:
        raise ValueError(f"not JSON ({e.reason}): {e}") from e
    if not (isinstance(change, dict) and len(change) == 1):
        raise ValueError("not an object naming one change")
    (what, value), = change.items()
    if what in ("key", "limits") and isinstance(value, str) and 0 < len(value) <= 128:
        return {("key_id" if what == "key" else what): value}
    if what == "budget" and isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        return {"budget": tuple(value)}
    raise ValueError(f"unknown change {what!r}")


class PgKeyStore(PgStore, KeyRecords):
    """API keys in PostgreSQL, stored only as a hash; the plaintext is returned once by create()."""

    def __init__(self, dsn: str, cache_ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 listened_ttl_s: float = 300.0):
        KeyRecords.__init__(self, cache_ttl_s, clock)
        PgStore.__init__(self, dsn, SCHEMA)
        self.listened_ttl_s = listened_ttl_s
        self.listening = False  # a LISTEN is in place now: cached entries hold for listened_ttl_s
        self.notifications_ignored = 0
        self._listener: asyncio.Task | None = None

    def _ttl(self) -> float:
        return self.listened_ttl_s if self.listening else self.cache_ttl_s

    def _notify(self, tx, **change) -> None:
        tx.execute("SELECT pg_notify(?, ?)", (CHANNEL, json.dumps(change, separators=(",", ":"))))

    def on_notification(self, payload: str) -> None:
        try:
            change = parse_change(payload)
        except ValueError as e:
            self.notifications_ignored += 1
            log.warning("ignored a %s notification (%d so far): %s", CHANNEL, self.notifications_ignored, e)
            return
        self.invalidate(**change)

    def start_listening(self) -> asyncio.Task:
        """Start (once per event loop) the task that listens for changes; ``aclose`` stops it."""
        task = self._listener
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            self._listener = task = asyncio.get_running_loop().create_task(self.listen())
        return task

    async def listen(self, retry_s: float = 0.5, max_retry_s: float = 5.0) -> None:
        """Drop cached entries as their changes are notified, reconnecting (with a growing pause)
        whenever the connection breaks; runs until cancelled."""
        pause = retry_s
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(self._dsn, autocommit=True,
                                                                 connect_timeout=max(1, round(self.timeout_s))) as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    self.invalidate()  # whatever changed while nobody listened
                    self.listening, pause = True, retry_s
                    async for n in conn.notifies():
                        self.on_notification(n.payload)
            except psycopg.Error as e:
                log.warning("key store notifications lost (%s); reconnecting in %.1f s", e, pause)
            finally:
                if self.listening:  # until it is back, nothing cached is trusted longer than without it
                    self.listening = False
                    self.shorten(self._clock() + self.cache_ttl_s)
            await asyncio.sleep(pause)
            pause = min(max_retry_s, pause * 2)

    async def aclose(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
            self._listener = None
        await PgStore.aclose(self)

    async def verify_async(self, presented: str):
        self.start_listening()  # the replica's listener, from its first request on
        return await KeyRecords.verify_async(self, presented)
