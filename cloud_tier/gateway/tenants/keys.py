"""API keys bound to tenants, kept as sha256 hashes, with the tenants' limits and the budgets of
tenants and keys: one implementation of their semantics (``KeyRecords``) here, kept in SQLite
(``keys_sqlite.KeyStore``) or in PostgreSQL for several gateway replicas (``keys_pg.PgKeyStore``).

A key reads ``csk-<key_id>-<secret>``: the 8-character ``key_id`` is public (listings, metrics,
revocation) and selects the row; the whole key's hash is then compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import string
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from cascade.protocol import INT32
from sync.sql_async import SyncBackedSql, run_now

SCOPES = ("infer", "admin")
PERIODS = ("day", "month")  # budgets run per UTC calendar day or month
BUDGET_SCOPES = ("tenant", "key")
KEY_PREFIX = "csk-"

_TENANT_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_DEVICE_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
# token_urlsafe(32) is 43 characters of the URL-safe base64 alphabet
_KEY_RE = re.compile(r"csk-([a-z0-9]{8})-([A-Za-z0-9_-]{43})")
_KEY_ID_ALPHABET = string.ascii_lowercase + string.digits


def _check_limit(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0 (0: no limit), not {value!r}")


def check_priority(value: int) -> None:
    """A priority is an int32 (what the engines store); lower is served first."""
    if not (isinstance(value, int) and not isinstance(value, bool) and INT32[0] <= value <= INT32[1]):
        raise ValueError(f"priority must be an integer in [{INT32[0]}, {INT32[1]}], not {value!r}")


def _check_tenant(tenant: str) -> None:
    if not (isinstance(tenant, str) and _TENANT_RE.fullmatch(tenant)):
        raise ValueError(f"tenant names are 1-64 characters of [A-Za-z0-9_.-], not {tenant!r}")


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    tenant: str
    device: str | None
    scopes: frozenset[str]
    rps: float  # this key's own limits; 0: none
    tpm: float
    created_at: float
    revoked: bool = False
    # the engine priority of this key's requests (lower is served first, and preempts later ones); a
    # request may only ask for a later one (a larger number)
    priority: int = 0

    def __post_init__(self):
        _check_tenant(self.tenant)
        check_priority(self.priority)
        if self.device is not None and not _DEVICE_RE.fullmatch(self.device):
            raise ValueError(f"device names are 1-128 characters of [A-Za-z0-9_.:-], "
                             f"not {self.device!r}")
        if not self.scopes:
            raise ValueError("a key needs at least one scope")
        if unknown := self.scopes - set(SCOPES):
            raise ValueError(f"unknown scope(s) {sorted(unknown)}; known: {', '.join(SCOPES)}")
        if self.device is not None and "admin" in self.scopes:
            raise ValueError("device keys cannot be admin")
        _check_limit("rps", self.rps)
        _check_limit("tpm", self.tpm)


@dataclass(frozen=True)
class Budget:
    """What a tenant or a key may spend per ``period``: ``tokens`` (prompt + completion) and/or
    ``usd`` (priced by ``[gateway] model_prices``); 0: no cap."""

    tokens: float = 0.0
    usd: float = 0.0
    period: str = "month"

    def __post_init__(self):
        _check_limit("budget tokens", self.tokens)
        _check_limit("budget usd", self.usd)
        if self.period not in PERIODS:
            raise ValueError(f"a budget period is {' or '.join(PERIODS)}, not {self.period!r}")

    @property
    def active(self) -> bool:
        return self.tokens > 0 or self.usd > 0


@dataclass(frozen=True)
class TenantLimits:
    tenant: str
    rps: float = 0.0  # 0: none
    tpm: float = 0.0
    # the tightest ttft_slo_s / tpot_slo_s its requests may ask; 0: the gateway's [gateway] min_*_slo_s
    min_ttft_slo_s: float = 0.0
    min_tpot_slo_s: float = 0.0

    def __post_init__(self):
        _check_tenant(self.tenant)
        _check_limit("tenant rps", self.rps)
        _check_limit("tenant tpm", self.tpm)
        _check_limit("min_ttft_slo_s", self.min_ttft_slo_s)
        _check_limit("min_tpot_slo_s", self.min_tpot_slo_s)

    def slo_floors(self, default_ttft_s: float, default_tpot_s: float) -> tuple[float, float]:
        """The tightest (TTFT, TPOT) targets this tenant's requests may ask: its own, else the defaults."""
        return self.min_ttft_slo_s or default_ttft_s, self.min_tpot_slo_s or default_tpot_s


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _row_to_key(row: dict) -> ApiKey:
    return ApiKey(key_id=row["key_id"], tenant=row["tenant"], device=row["device"],
                  scopes=frozenset(row["scopes"].split()), rps=row["rps"], tpm=row["tpm"],
                  created_at=row["created_at"], revoked=bool(row["revoked"]), priority=row["priority"])


class KeyRecords(SyncBackedSql):
    """The key store's semantics over SQL that SQLite and PostgreSQL both speak. A backend gives
    ``_write()`` (a transaction whose ``execute`` returns a cursor) and ``_read()`` (rows as dicts),
    their awaitable twins ``_atx()`` / ``_aread()`` (``sync.sql_async``), and creates the tables.

    verify(), tenant_limits() and budget() (and their awaited ``*_async`` twins, which the gateway's
    request path uses) answer from a per-process cache for up to ``_ttl()``, so a revocation or a
    change of limits or budgets made elsewhere (another process, another replica) takes effect
    within that time (at once in the process that made it), or as soon as the backend pushes it
    (``invalidate``: PostgreSQL's NOTIFY, ``keys_pg``).
    """

    def __init__(self, cache_ttl_s: float, clock: Callable[[], float]):
        self.cache_ttl_s = cache_ttl_s
        self._clock = clock
        self._epoch = 0  # bumped by every invalidation: a load that began before one is not cached
        # key_id -> (sha256 hex, key, expires at); only live keys, so its size is bounded by them
        self._keys: dict[str, tuple[str, ApiKey, float]] = {}
        # ("limits", tenant) | ("budget", scope, name) -> (value, expires at)
        self._settings: dict[tuple, tuple[TenantLimits | Budget, float]] = {}

    def create(self, tenant: str, device: str | None = None, scopes: Iterable[str] = ("infer",),
               rps: float = 0.0, tpm: float = 0.0, priority: int = 0) -> tuple[str, ApiKey]:
        """A new key for ``tenant`` (created with no limits if new). ``rps``/``tpm`` are the
        key's own limits, ``priority`` its requests' engine priority. Returns the plaintext, never
        stored, and the key's record."""
        if isinstance(scopes, str):
            scopes = (scopes,)
        for _ in range(5):
            key_id = "".join(secrets.choice(_KEY_ID_ALPHABET) for _ in range(8))
            record = ApiKey(key_id=key_id, tenant=tenant, device=device,
                            scopes=frozenset(scopes), rps=float(rps), tpm=float(tpm),
                            created_at=time.time(), priority=priority)  # validates
            plaintext = f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"
            with self._write() as tx:
                tx.execute("INSERT INTO tenants (name, rps, tpm, created_at) VALUES (?, 0, 0, ?) "
                           "ON CONFLICT (name) DO NOTHING", (tenant, record.created_at))
                inserted = tx.execute(
                    "INSERT INTO api_keys (key_id, key_hash, tenant, device, scopes, rps, tpm, created_at, "
                    "revoked, priority) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, ?) ON CONFLICT (key_id) DO NOTHING",
                    (key_id, _hash(plaintext), tenant, device, " ".join(sorted(record.scopes)),
                     record.rps, record.tpm, record.created_at, record.priority)).rowcount > 0
            if inserted:
                return plaintext, record
            # key_id taken (1 in 36^8 per existing key): draw another
        raise RuntimeError("could not draw an unused key id")

    def verify(self, presented: str) -> ApiKey | None:
        """The live key ``presented`` is, or None (unknown, revoked or malformed)."""
        return run_now(self._verify(self._sread, presented))

    async def verify_async(self, presented: str) -> ApiKey | None:
        """``verify``, awaited: a cache miss reads the database without blocking the event loop."""
        return await self._verify(self._aread, presented)

    async def _verify(self, read, presented: str) -> ApiKey | None:
        m = _KEY_RE.fullmatch(presented) if isinstance(presented, str) else None
        if m is None:
            return None
        key_id, now = m.group(1), self._clock()
        hit = self._keys.get(key_id)
        if hit is None or hit[2] <= now:
            epoch = self._epoch
            rows = await read("SELECT * FROM api_keys WHERE key_id = ?", [key_id])
            if not rows or rows[0]["revoked"]:
                self._keys.pop(key_id, None)
                return None
            hit = (rows[0]["key_hash"], _row_to_key(rows[0]), now + self._ttl())
            if epoch == self._epoch:  # else an invalidation came in while it was read: use it, keep nothing
                self._keys[key_id] = hit
        stored, key, _ = hit
        return key if hmac.compare_digest(stored, _hash(presented)) else None

    def _ttl(self) -> float:
        """How long a cached key, limit or budget is trusted."""
        return self.cache_ttl_s

    def invalidate(self, key_id: str | None = None, limits: str | None = None,
                   budget: tuple[str, str] | None = None) -> None:
        """Forget what this process cached of a key, a tenant's limits or a budget (a change made
        elsewhere); nothing named: forget everything."""
        self._epoch += 1
        if key_id is None and limits is None and budget is None:
            self._keys.clear()
            self._settings.clear()
            return
        if key_id is not None:
            self._keys.pop(key_id, None)
        if limits is not None:
            self._settings.pop(("limits", limits), None)
        if budget is not None:
            self._settings.pop(("budget", *budget), None)

    def shorten(self, until: float) -> None:
        """Trust nothing cached past ``until``."""
        self._keys = {k: (h, key, min(exp, until)) for k, (h, key, exp) in self._keys.items()}
        self._settings = {w: (v, min(exp, until)) for w, (v, exp) in self._settings.items()}

    def _notify(self, tx, **change) -> None:
        """Tell the other processes sharing the database of a change, inside its transaction
        (``keys_pg``: NOTIFY); here, nothing (they find out when their cache expires)."""

    def revoke(self, key_id: str) -> bool:
        """Revoke a key (already revoked: still True). False when no key has this id."""
        with self._write() as tx:
            found = tx.execute("UPDATE api_keys SET revoked = 1 WHERE key_id = ?", (key_id,)).rowcount > 0
            self._notify(tx, key=key_id)
        self.invalidate(key_id=key_id)
        return found

    def list(self, tenant: str | None = None) -> list[ApiKey]:
        """Every key, revoked ones included, oldest first."""
        where, params = ("WHERE tenant = ?", [tenant]) if tenant is not None else ("", [])
        return [_row_to_key(r) for r in self._read(f"SELECT * FROM api_keys {where} ORDER BY created_at, key_id",
                                                   params)]

    def set_tenant_limits(self, tenant: str, rps: float | None = None, tpm: float | None = None,
                          min_ttft_slo_s: float | None = None, min_tpot_slo_s: float | None = None) -> TenantLimits:
        """Set a tenant's limits (None: leave as is), creating the tenant if new."""
        TenantLimits(tenant, rps or 0.0, tpm or 0.0, min_ttft_slo_s or 0.0, min_tpot_slo_s or 0.0)  # validates
        with self._write() as tx:
            tx.execute("INSERT INTO tenants (name, rps, tpm, created_at) VALUES (?, 0, 0, ?) "
                       "ON CONFLICT (name) DO NOTHING", (tenant, time.time()))
            tx.execute("UPDATE tenants SET rps = coalesce(?, rps), tpm = coalesce(?, tpm), "
                       "min_ttft_slo_s = coalesce(?, min_ttft_slo_s), min_tpot_slo_s = coalesce(?, min_tpot_slo_s) "
                       "WHERE name = ?", (rps, tpm, min_ttft_slo_s, min_tpot_slo_s, tenant))
            self._notify(tx, limits=tenant)
        return self._refresh(("limits", tenant), lambda: self._read_limits(tenant))

    def tenant_limits(self, tenant: str) -> TenantLimits:
        """A tenant's limits (an unknown tenant has none), cached like verify()."""
        return run_now(self._cached(("limits", tenant), self._sread))

    async def tenant_limits_async(self, tenant: str) -> TenantLimits:
        """``tenant_limits``, awaited."""
        return await self._cached(("limits", tenant), self._aread)

    def _read_limits(self, tenant: str) -> TenantLimits:
        return run_now(self._load(("limits", tenant), self._sread))

    # -- budgets (tenants/budgets.py spends them) ---------------------------------------------

    def set_budget(self, scope: str, name: str, tokens: float | None = None, usd: float | None = None,
                   period: str | None = None) -> Budget:
        """Set the budget of a tenant or a key (``scope`` "tenant" or "key", ``name`` its name or
        key_id; None: leave as is, 0: no cap)."""
        _check_budget_scope(scope, name)
        Budget(tokens or 0.0, usd or 0.0, period or "month")  # validates the values given
        with self._write() as tx:
            tx.execute("INSERT INTO budgets (scope, name, tokens, usd, period) VALUES (?, ?, 0, 0, 'month') "
                       "ON CONFLICT (scope, name) DO NOTHING", (scope, name))
            tx.execute("UPDATE budgets SET tokens = coalesce(?, tokens), usd = coalesce(?, usd), "
                       "period = coalesce(?, period) WHERE scope = ? AND name = ?", (tokens, usd, period, scope, name))
            self._notify(tx, budget=[scope, name])
        return self._refresh(("budget", scope, name), lambda: self._read_budget(scope, name))

    def budget(self, scope: str, name: str) -> Budget:
        """The budget of a tenant or a key (none set: no cap, monthly), cached like verify()."""
        return run_now(self._cached(("budget", scope, name), self._sread))

    async def budget_async(self, scope: str, name: str) -> Budget:
        """``budget``, awaited."""
        return await self._cached(("budget", scope, name), self._aread)

    def _read_budget(self, scope: str, name: str) -> Budget:
        return run_now(self._load(("budget", scope, name), self._sread))

    async def _load(self, what: tuple, read) -> TenantLimits | Budget:
        """A tenant's limits (``("limits", tenant)``) or a budget (``("budget", scope, name)``) as
        the database holds them."""
        if what[0] == "limits":
            tenant = what[1]
            _check_tenant(tenant)
            rows = await read("SELECT rps, tpm, min_ttft_slo_s, min_tpot_slo_s FROM tenants WHERE name = ?", [tenant])
            return TenantLimits(tenant, **{k: rows[0][k] for k in ("rps", "tpm", "min_ttft_slo_s", "min_tpot_slo_s")}
                                ) if rows else TenantLimits(tenant)
        _, scope, name = what
        _check_budget_scope(scope, name)
        rows = await read("SELECT tokens, usd, period FROM budgets WHERE scope = ? AND name = ?", [scope, name])
        return Budget(rows[0]["tokens"], rows[0]["usd"], rows[0]["period"]) if rows else Budget()

    def add_spend(self, charges: Sequence[tuple[str, str, str, float, float, float]]) -> None:
        """Add (scope, name, period id, tokens, usd, ttl_s) to the spend counters, in one
        transaction (ttl_s is for Redis' counters: a period's row here is kept)."""
        run_now(self._add_spend(self._stx, charges))

    async def add_spend_async(self, charges: Sequence[tuple[str, str, str, float, float, float]]) -> None:
        await self._add_spend(self._atx, charges)

    async def _add_spend(self, transaction, charges) -> None:
        async with transaction() as tx:
            for scope, name, period_id, tokens, usd, _ in charges:
                await tx.execute(
                    "INSERT INTO spend (scope, name, period, tokens, usd) VALUES (?, ?, ?, ?, ?) "
                    "ON CONFLICT (scope, name, period) DO UPDATE SET tokens = spend.tokens + excluded.tokens, "
                    "usd = spend.usd + excluded.usd", (scope, name, period_id, tokens, usd))

    def spent(self, counters: Sequence[tuple[str, str, str]]) -> list[tuple[float, float]]:
        """(tokens, usd) spent by each (scope, name, period id); (0, 0) for none."""
        return run_now(self._spent(self._sread, counters))

    async def spent_async(self, counters: Sequence[tuple[str, str, str]]) -> list[tuple[float, float]]:
        return await self._spent(self._aread, counters)

    async def _spent(self, read, counters) -> list[tuple[float, float]]:
        out = []
        for scope, name, period_id in counters:
            rows = await read("SELECT tokens, usd FROM spend WHERE scope = ? AND name = ? AND period = ?",
                              [scope, name, period_id])
            out.append((rows[0]["tokens"], rows[0]["usd"]) if rows else (0.0, 0.0))
        return out

    async def _cached(self, what: tuple, read):
        now = self._clock()
        hit = self._settings.get(what)
        if hit is not None and hit[1] > now:
            return hit[0]
        epoch = self._epoch
        value = await self._load(what, read)
        if epoch == self._epoch:
            self._settings[what] = (value, now + self._ttl())
        return value

    def _refresh(self, what: tuple, load: Callable):
        value = load()
        self._settings[what] = (value, self._clock() + self._ttl())
        return value


def _check_budget_scope(scope: str, name: str) -> None:
    if scope not in BUDGET_SCOPES:
        raise ValueError(f"a budget's scope is {' or '.join(BUDGET_SCOPES)}, not {scope!r}")
    if scope == "tenant":
        _check_tenant(name)
    elif not (isinstance(name, str) and re.fullmatch(r"[a-z0-9]{8}", name)):
        raise ValueError(f"a key id is 8 characters of [a-z0-9], not {name!r}")
