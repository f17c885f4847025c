"""The gateway's token-bucket quotas in Redis, shared by several gateway replicas: a tenant's
limit is the limit across all of them. ``RedisQuotas`` has ``quotas.Quotas``' interface and
decisions (every applicable bucket or none, the longest wait, ``tpm_never``); each call is ONE
Lua script, atomic across replicas, with Redis' own TIME as the clock (so the replicas' clocks do
not matter). A bucket is a hash {level, at, rate, cap}; a missing one is full, and one expires
once it would have refilled and then sat idle for ``idle_s``."""

from __future__ import annotations

import math

import redis

from cloud_tier.gateway.tenants.quotas import _EPS, Limits, QuotaDecision

# KEYS: the buckets. ARGV[1]: "admit" or "reconcile"; ARGV[2]: idle seconds kept after a full refill;
# admit: then (rate, capacity, amount) per bucket; reconcile: then the tokens to add per bucket
# (a refund > 0, capped at the capacity; a charge < 0, which may go into debt, down to -capacity as in
# quotas.TokenBucket).
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
local levels, worst, worst_i = {}, 0, 0
for i, key in ipairs(KEYS) do
  local rate, cap, amount = tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1]), tonumber(ARGV[3 * i + 2])
  local b = redis.call('HMGET', key, 'level', 'at', 'rate', 'cap')
  local level = cap  -- new, or its limits changed: a full bucket
  if b[1] and tonumber(b[3]) == rate and tonumber(b[4]) == cap then level = level_of(b, rate, cap) end
  levels[i] = level
  local wait = 0
  if amount > cap then wait = math.huge elseif amount - level > tonumber(ARGV[#ARGV]) then
    wait = (amount - level) / rate end
  if wait > worst then worst, worst_i = wait, i end
end
if worst_i > 0 then return {0, tostring(worst), worst_i} end
for i, key in ipairs(KEYS) do
  store(key, levels[i] - tonumber(ARGV[3 * i + 2]), tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1]))
end
return {1, '0', 0}
"""


def connect(url: str) -> redis.Redis:
    """A client for the gateway's Redis; short timeouts, so a dead Redis fails requests instead of
    stalling them."""
    return redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0, health_check_interval=30)


class RedisQuotas:
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

    def admit(self, tenant: str, key_id: str, tenant_limits: Limits, key_limits: Limits,
              predicted_tokens: int) -> QuotaDecision:
        """Take one request and predicted_tokens from every applicable bucket, or refuse with the
        longest wait among the buckets that refused (tpm_never wins: no wait is enough)."""
        checks = [*self._applicable(tenant, "tenant", tenant, tenant_limits, predicted_tokens),
                  *self._applicable(tenant, "key", key_id, key_limits, predicted_tokens)]
        if not checks:
            return QuotaDecision(True)
        args = ["admit", self.idle_s, *(repr(float(x)) for *_, bucket in checks for x in bucket), repr(_EPS)]
        allowed, wait, index = self._script(keys=[c[2] for c in checks], args=args)
        if allowed:
            return QuotaDecision(True)
        scope, kind = checks[index - 1][:2]
        wait = float(wait)
        return QuotaDecision(False, wait, "tpm_never" if math.isinf(wait) else kind, scope)

    def reconcile(self, tenant: str, key_id: str, predicted_tokens: int, actual_tokens: int) -> None:
        """Settle the tpm buckets once the real token count is known: refund predicted - actual,
        or charge the difference when actual > predicted."""
        diff = predicted_tokens - actual_tokens
        if diff:
            self._script(keys=[self._key(tenant, "tenant", tenant, "tpm"), self._key(tenant, "key", key_id, "tpm")],
                         args=["reconcile", self.idle_s, diff, diff])

    def close(self) -> None:
        self._redis.close()
