"""The gateway's token-bucket quotas in Redis, shared by several gateway replicas: a tenant's
limit is the limit across all of them. ``RedisQuotas`` has ``quotas.Quotas``' interface and
decisions (every applicable bucket or none, the longest wait, ``tpm_never``); each call is ONE
Lua script, atomic across replicas, with Redis' own TIME as the clock (so the replicas' clocks do
not matter). A bucket is a hash {level, at, rate, cap}; a missing one is full, and one expires
once it would have refilled and then sat idle for ``idle_s``.

The gateway's request path awaits the same script through ``pipeline.state_redis``, where a
``lookup`` call also GETs the request's cached answer and, on a hit, admits it (one request, no
tokens) in the same call: one round trip for the cache and the quota. Every key one call names
carries the tenant's hash tag (``{tenant}``), so a call touches one Redis Cluster slot."""

from __future__ import annotations

import math

import redis

from cloud_tier.gateway.tenants.quotas import _EPS, Limits, QuotaDecision

# KEYS: the buckets (for "lookup" and "lookup_admit": the cached answer's key first). ARGV[1]: "admit",
# "lookup", "lookup_admit" or "reconcile"; ARGV[2]: idle seconds kept after a full refill. admit and
# lookup: then (rate, capacity, amount) per bucket and the float slack last (lookup: on a miss nothing is
# taken and {2, '0', 0} comes back; on a hit the buckets are admitted as given and the answer comes
# fourth, its ms to live fifth). lookup_admit: as lookup, then one more amount per bucket, a miss's: a
# miss is admitted with those at once (one round trip for the cache and the quota), its answer false.
# reconcile: then the tokens to add per bucket (a refund > 0, capped at the capacity; a charge < 0,
# which may go into debt, down to -capacity as in quotas.TokenBucket).
_SCRIPT = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local idle_ms = tonumber(ARGV[2]) * 1000
local function level_of(b, rate, cap)
  return math.min(cap, tonumber(b[1]) + (now - tonumber(b[2])) * rate)
end
local function store(key, level, rate, cap)
  redis.call('HSET', key, 'level', string.format('%.17g', level), 'at', string.format('%.17g', now),
             'rate', string.format('%.17g', rate), 'cap', string.format('%.17g', cap))
  redis.call('PEXPIRE', key, math.ceil((cap - level) / rate * 1000 + idle_ms))
end
if ARGV[1] == 'reconcile' then
  for i, key in ipairs(KEYS) do
    local b = redis.call('HMGET', key, 'level', 'at', 'rate', 'cap')
    if b[1] then
      local rate, cap = tonumber(b[3]), tonumber(b[4])
      store(key, math.max(-cap, math.min(cap, level_of(b, rate, cap) + tonumber(ARGV[2 + i]))), rate, cap)
    end
  end
  return 1
end
local first, answer, miss = 1, false, false
if ARGV[1] == 'lookup' or ARGV[1] == 'lookup_admit' then
  answer = redis.call('GET', KEYS[1])
  first = 2
  if not answer then
    if ARGV[1] == 'lookup' then return {2, '0', 0} end
    miss = true  -- lookup_admit: a miss is admitted at once, with the amounts given after the slack
  end
end
local n = #KEYS - first + 1
local levels, amounts, worst, worst_i = {}, {}, 0, 0
for k = first, #KEYS do
  local i = k - first + 1
  local rate, cap, amount = tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1]), tonumber(ARGV[3 * i + 2])
  if miss then amount = tonumber(ARGV[3 * n + 3 + i]) end
  amounts[i] = amount
  local b = redis.call('HMGET', KEYS[k], 'level', 'at', 'rate', 'cap')
  local level = cap  -- new, or its limits changed: a full bucket
  if b[1] and tonumber(b[3]) == rate and tonumber(b[4]) == cap then level = level_of(b, rate, cap) end
  levels[i] = level
  local wait = 0
  if amount > cap then wait = math.huge elseif amount - level > tonumber(ARGV[3 * n + 3]) then
    wait = (amount - level) / rate end
  if wait > worst then worst, worst_i = wait, i end
end
local ttl = false
if answer then ttl = redis.call('PTTL', KEYS[1]) end
if worst_i > 0 then return {0, tostring(worst), worst_i, answer, ttl} end
for k = first, #KEYS do
  local i = k - first + 1
  store(KEYS[k], levels[i] - amounts[i], tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1]))
end
return {1, '0', 0, answer, ttl}
"""


def connect(url: str) -> redis.Redis:
    """A client for the gateway's Redis; short timeouts, so a dead Redis fails requests instead of
    stalling them."""
    return redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0, health_check_interval=30)


def decision_of(checks: list, reply) -> QuotaDecision:
    """The decision the script's reply ``[allowed, wait, index, ...]`` gives for ``checks``."""
    allowed, wait, index = reply[:3]
    if allowed:
        return QuotaDecision(True)
    scope, kind = checks[index - 1][:2]
    wait = float(wait)
    return QuotaDecision(False, wait, "tpm_never" if math.isinf(wait) else kind, scope)


class RedisQuotas:
    script = _SCRIPT

    def __init__(self, url: str, prefix: str = "cascade:quota:", idle_s: float = 600.0):
        self._redis = connect(url)
        self._script = self._redis.register_script(_SCRIPT)
        self._redis.script_load(_SCRIPT)  # now, so that an unreachable Redis fails the gateway's start
        self._prefix = prefix
        self.idle_s = idle_s  # kept after a refill: a request still running reconciles into its bucket

    def _key(self, tenant: str, scope: str, ident: str, kind: str) -> str:
        # every bucket of a tenant shares its hash tag, so one script touches one Redis Cluster slot
        return f"{self._prefix}{{{tenant}}}:{scope}:{ident}:{kind}"

    def _applicable(self, tenant: str, scope: str, ident: str, limits: Limits, tokens: int):
        if limits.rps > 0:
            yield scope, "rps", self._key(tenant, scope, ident, "rps"), (limits.rps, max(1.0, limits.rps), 1)
        if limits.tpm > 0:
            yield scope, "tpm", self._key(tenant, scope, ident, "tpm"), (limits.tpm / 60.0, limits.tpm, tokens)

    def checks(self, tenant: str, key_id: str, tenant_limits: Limits, key_limits: Limits, tokens: int) -> list:
        """The buckets a request of ``key_id`` must pass: (scope, kind, key, (rate, capacity, amount))."""
        return [*self._applicable(tenant, "tenant", tenant, tenant_limits, tokens),
                *self._applicable(tenant, "key", key_id, key_limits, tokens)]

    def admit_args(self, checks: list) -> list:
        return [self.idle_s, *(repr(float(x)) for *_, bucket in checks for x in bucket), repr(_EPS)]

    def reconcile_call(self, tenant: str, key_id: str, diff: int) -> tuple[list, list]:
        """The script's (keys, args) that settle the tpm buckets by ``diff`` tokens."""
        return ([self._key(tenant, "tenant", tenant, "tpm"), self._key(tenant, "key", key_id, "tpm")],
                ["reconcile", self.idle_s, diff, diff])

    def admit(self, tenant: str, key_id: str, tenant_limits: Limits, key_limits: Limits,
              predicted_tokens: int) -> QuotaDecision:
        """Take one request and predicted_tokens from every applicable bucket, or refuse with the
        longest wait among the buckets that refused (tpm_never wins: no wait is enough)."""
        checks = self.checks(tenant, key_id, tenant_limits, key_limits, predicted_tokens)
        if not checks:
            return QuotaDecision(True)
        return decision_of(checks, self._script(keys=[c[2] for c in checks], args=["admit", *self.admit_args(checks)]))

    def reconcile(self, tenant: str, key_id: str, predicted_tokens: int, actual_tokens: int) -> None:
        """Settle the tpm buckets once the real token count is known: refund predicted - actual,
        or charge the difference when actual > predicted."""
        diff = predicted_tokens - actual_tokens
        if diff:
            keys, args = self.reconcile_call(tenant, key_id, diff)
            self._script(keys=keys, args=args)

    def close(self) -> None:
        self._redis.close()
