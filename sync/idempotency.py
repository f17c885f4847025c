"""The cloud's Idempotency-Key store: per tenant, a key maps to the one response it produced.

A row's life: ``claim`` writes it ``in_progress`` under a fresh owner token; the claimant then
``complete``s it (``done``, the result stored for replays) or ``release``s it (``released``: free
for the next claim), and ``renew``s its lease while it runs (``heartbeat``). An ``in_progress``
row whose lease has run out was left by a crashed gateway and is free too; its old owner's
``complete``, ``release`` and ``renew`` are then no-ops, so they never touch the next claim.
Every row is deleted ``ttl_s`` after it was claimed.

Each operation is written once (``sync.sql_async``): the gateway awaits ``aclaim``, ``acomplete``,
``arelease``, ``heartbeat`` and ``wait`` (PostgreSQL through its async pool), everything else
calls ``claim``, ``complete``, ``release`` and ``renew``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from sync.sql_async import SyncBackedSql, run_now
from sync.sqlite import SQLiteStore

log = logging.getLogger(__name__)

MAX_KEY_LEN = 255


class ClaimState(StrEnum):
    NEW = "new"  # the caller owns the key: run the request, then complete() or release()
    DONE = "done"  # replay ``result``
    IN_PROGRESS = "in_progress"  # another caller is running it: wait()
    MISMATCH = "mismatch"  # the key was used for a different request


class _Row(StrEnum):
    IN_PROGRESS = "in_progress"
    DONE = "done"
    RELEASED = "released"


@dataclass(frozen=True)
class Claim:
    state: ClaimState
    result: Any = None  # the stored result when state is DONE
    owner: str | None = field(default=None, compare=False)  # the claimant's token when state is NEW


class IdempotencyRecords(SyncBackedSql):
    """The store's semantics, over SQL both SQLite and PostgreSQL speak: per-tenant
    Idempotency-Key -> stored response. The first request with a key claims it; a concurrent
    duplicate waits for the first to finish; a replay gets the stored result; expired keys are
    collected. A backend gives ``_write()`` (a transaction whose ``execute`` returns a cursor)
    and ``_read()`` (rows as dicts): ``IdempotencyStore`` (SQLite) and
    ``sync.idempotency_pg.PgIdempotencyStore``."""

    # claim() reads the row it may take over inside its write transaction: SQLite's BEGIN
    # IMMEDIATE already holds the database's write lock, PostgreSQL must lock the row
    _FOR_UPDATE = ""

    def __init__(self, ttl_s: float, clock: Callable[[], float], lease_s: float):
        if not 0 < lease_s <= ttl_s:
            raise ValueError(f"need 0 < lease_s <= ttl_s, got lease_s={lease_s} ttl_s={ttl_s}")
        self.ttl_s = ttl_s
        self.lease_s = lease_s
        self._clock = clock

    def _is_free(self, state: str, created_at: float, updated_at: float, now: float) -> bool:
        return (state == _Row.RELEASED
                or created_at + self.ttl_s <= now
                or (state == _Row.IN_PROGRESS and updated_at + self.lease_s <= now))

    def claim(self, tenant: str, key: str, request_hash: str) -> Claim:
        """Claim ``key`` for a request whose canonical form hashes to ``request_hash``. A NEW claim
        carries the owner token that ``complete``, ``release`` and ``renew`` need."""
        return run_now(self._claim(self._stx, tenant, key, request_hash))

    async def aclaim(self, tenant: str, key: str, request_hash: str) -> Claim:
        """``claim``, awaited."""
        return await self._claim(self._atx, tenant, key, request_hash)

    async def _claim(self, transaction, tenant: str, key: str, request_hash: str) -> Claim:
        if not 0 < len(key) <= MAX_KEY_LEN:
            raise ValueError(f"an idempotency key is 1-{MAX_KEY_LEN} characters")
        now, owner = self._clock(), secrets.token_hex(16)
        async with transaction() as tx:
            # the insert is the atomic claim of a new key: of two racing claimants one inserts, the
            # other waits for its commit and then finds the row
            if (await tx.execute(
                    "INSERT INTO idempotency (tenant, key, request_hash, state, result, created_at, updated_at, "
                    "owner) VALUES (?, ?, ?, ?, NULL, ?, ?, ?) ON CONFLICT (tenant, key) DO NOTHING",
                    (tenant, key, request_hash, _Row.IN_PROGRESS.value, now, now, owner))).rowcount > 0:
                return Claim(ClaimState.NEW, owner=owner)
            row = (await tx.execute(
                "SELECT request_hash, state, result, created_at, updated_at FROM idempotency "
                "WHERE tenant = ? AND key = ?" + self._FOR_UPDATE, (tenant, key))).fetchone()
            if self._is_free(row[1], row[3], row[4], now):
                await tx.execute(
                    "UPDATE idempotency SET request_hash = ?, state = ?, result = NULL, created_at = ?, "
                    "updated_at = ?, owner = ? WHERE tenant = ? AND key = ?",
                    (request_hash, _Row.IN_PROGRESS.value, now, now, owner, tenant, key))
                return Claim(ClaimState.NEW, owner=owner)
        stored_hash, state, result = row[0], row[1], row[2]
        if stored_hash != request_hash:
            return Claim(ClaimState.MISMATCH)
        if state == _Row.DONE:
            return Claim(ClaimState.DONE, json.loads(result))
        return Claim(ClaimState.IN_PROGRESS)

    def complete(self, tenant: str, key: str, result: Any, *, owner: str) -> bool:
        """Store the claimed request's JSON-serialisable ``result`` for replays. False (nothing
        stored) when ``owner`` no longer holds the claim."""
        return run_now(self._complete(self._stx, tenant, key, result, owner))

    async def acomplete(self, tenant: str, key: str, result: Any, *, owner: str) -> bool:
        """``complete``, awaited."""
        return await self._complete(self._atx, tenant, key, result, owner)

    async def _complete(self, transaction, tenant: str, key: str, result: Any, owner: str) -> bool:
        payload = json.dumps(result, separators=(",", ":"))  # fails before anything is written
        stored = await self._update_held(transaction, tenant, key, owner, "state = ?, result = ?",
                                         (_Row.DONE.value, payload))
        if not stored:
            log.warning("idempotency key %r of tenant %r is not held by this request; result not stored",
                        key, tenant)
        return stored

    def release(self, tenant: str, key: str, *, owner: str) -> bool:
        """The claimed request failed: the next claim of ``key`` is new. False (a no-op) when
        ``owner`` no longer holds the claim."""
        return run_now(self._update_held(self._stx, tenant, key, owner, "state = ?", (_Row.RELEASED.value,)))

    async def arelease(self, tenant: str, key: str, *, owner: str) -> bool:
        """``release``, awaited."""
        return await self._update_held(self._atx, tenant, key, owner, "state = ?", (_Row.RELEASED.value,))

    def renew(self, tenant: str, key: str, *, owner: str) -> bool:
        """Extend the lease of a claim still running; False when ``owner`` no longer holds it
        (finished, or its lease ran out and someone else claimed it)."""
        return run_now(self._update_held(self._stx, tenant, key, owner, "request_hash = request_hash", ()))

    async def arenew(self, tenant: str, key: str, *, owner: str) -> bool:
        """``renew``, awaited."""
        return await self._update_held(self._atx, tenant, key, owner, "request_hash = request_hash", ())

    async def _update_held(self, transaction, tenant: str, key: str, owner: str, assignments: str,
                           values: tuple) -> bool:
        # the owner token alone decides: a claim taken over after its lease has another owner
        async with transaction() as tx:
            return (await tx.execute(
                f"UPDATE idempotency SET {assignments}, updated_at = ? "
                "WHERE tenant = ? AND key = ? AND owner = ? AND state = ?",
                (*values, self._clock(), tenant, key, owner, _Row.IN_PROGRESS.value))).rowcount > 0

    async def heartbeat(self, tenant: str, key: str, owner: str, every_s: float | None = None) -> None:
        """Renew the claim every ``every_s`` (default: a third of the lease) while its request runs;
        returns when the claim is no longer held. Cancel it when the request ends."""
        every_s = self.lease_s / 3 if every_s is None else every_s
        while True:
            await asyncio.sleep(every_s)
            try:
                held = await self.arenew(tenant, key, owner=owner)
            except ConnectionError as e:  # the database is away: the next beat tries again
                log.warning("idempotency key %r of tenant %r: the lease was not renewed: %s", key, tenant, e)
                continue
            if not held:
                log.warning("idempotency key %r of tenant %r: the claim was lost while running", key, tenant)
                return

    async def wait(self, tenant: str, key: str, timeout_s: float, poll_s: float = 0.05, *,
                   request_hash: str | None = None) -> Claim:
        """Poll until the request running under ``key`` ends, then claim the key as a new caller
        would: DONE (replay), NEW (it was released: the waiter now owns it and must complete()
        or release() it) or MISMATCH (someone else claimed it for another request meanwhile).
        IN_PROGRESS after ``timeout_s``. ``request_hash`` is the waiter's; by default the hash
        of the request it waits for, which the waiter matched to get IN_PROGRESS."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if request_hash is None:
            rows = await self._aread("SELECT request_hash FROM idempotency WHERE tenant = ? AND key = ?",
                                     (tenant, key))
            if not rows:
                raise LookupError(f"no claim of idempotency key {key!r} to wait for")
            request_hash = rows[0]["request_hash"]
        while True:
            claim = await self.aclaim(tenant, key, request_hash)
            remaining = deadline - loop.time()
            if claim.state != ClaimState.IN_PROGRESS or remaining <= 0:
                return claim
            await asyncio.sleep(min(poll_s, remaining))

    def collect_expired(self) -> int:
        """Delete the rows claimed more than ``ttl_s`` ago; returns how many."""
        with self._write() as tx:
            return tx.execute("DELETE FROM idempotency WHERE created_at <= ?", (self._clock() - self.ttl_s,)).rowcount

    def stats(self) -> dict[str, int]:
        """Rows by state: in_progress (abandoned ones included), done, released."""
        counts = dict.fromkeys((s.value for s in _Row), 0)
        for row in self._read("SELECT state, count(*) AS n FROM idempotency GROUP BY state"):
            counts[row["state"]] = row["n"]
        return counts


class IdempotencyStore(SQLiteStore, IdempotencyRecords):
    """The Idempotency-Key store in SQLite (WAL); several processes may share the file."""

    def __init__(self, path: Path | str, ttl_s: float = 24 * 3600,
                 clock: Callable[[], float] = time.time, lease_s: float = 600.0):
        IdempotencyRecords.__init__(self, ttl_s, clock, lease_s)
        SQLiteStore.__init__(self, path)
        with self._write():
            self._db["idempotency"].create(
                {"tenant": str, "key": str, "request_hash": str, "state": str, "result": str,
                 "created_at": float, "updated_at": float, "owner": str},
                pk=("tenant", "key"),
                not_null={"request_hash", "state", "created_at", "updated_at"},
                if_not_exists=True)
            self._db["idempotency"].create_index(["created_at"], if_not_exists=True)
            if "owner" not in self._db["idempotency"].columns_dict:  # a store from before owners
                self._db["idempotency"].add_column("owner", str)
