"""``state.RequestState`` on Redis, shared by gateway replicas: each call is ONE round trip on an
asyncio client (a non-transactional pipeline), so a slow Redis stalls only the requests waiting on
it, never the event loop. ``lookup``: one script call that GETs the cached answer (and its time
to live) and, on a hit, admits it against the tenant's and the key's buckets (``quotas_redis``'
script: every key it names carries the tenant's hash tag, one Cluster slot), plus an MGET of the
spend counters when a budget is active; no round trip at all for a hit this replica read less
than ``near_s`` ago when neither a quota nor a budget applies (``result_cache_redis``' near
cache). ``admit`` (a miss): the script and the MGET. ``settle``: the quota's true-up, the spend
increments and the cache's store script.

Failures keep today's meaning: a lookup that fails is a miss (logged) when no bucket applies, and
fails the request otherwise (the quota cannot be decided); a store that fails is logged."""

from __future__ import annotations

import logging

import redis
import redis.asyncio

from cloud_tier.gateway.pipeline.result_cache_redis import RedisResultCache
from cloud_tier.gateway.pipeline.state import Charges, Counters, Keep, Lookup, Quota
from cloud_tier.gateway.tenants.budgets import RedisSpend, spent_of
from cloud_tier.gateway.tenants.quotas import QuotaDecision
from cloud_tier.gateway.tenants.quotas_redis import RedisQuotas, decision_of

log = logging.getLogger(__name__)


class RedisState:
    def __init__(self, url: str, quotas: RedisQuotas, cache: RedisResultCache, spend: RedisSpend | None):
        self.quotas = quotas
        self.cache = cache
        self.spend = spend  # None: spend is counted in the key store (never with a Redis: stores.open_spend)
        self._redis = redis.asyncio.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0,
                                                   health_check_interval=30)
        self._scripts = {"quota": (quotas.script, None), "put": (cache.put_script, None),
                         "get": (cache.get_script, None)}

    async def _sha(self, name: str) -> str:
        source, sha = self._scripts[name]
        if sha is None:
            sha = await self._redis.script_load(source)
            self._scripts[name] = (source, sha)
        return sha

    async def _run(self, commands: list[tuple]) -> list:
        """Run ``commands`` ((method, *args); ("script", name, keys, args) for our scripts) in one
        pipeline; each one's reply or the exception it met. A script Redis no longer knows (it
        restarted) is loaded and its commands run once more."""
        replies = await self._pipeline(commands)
        missing = [i for i, r in enumerate(replies) if isinstance(r, redis.exceptions.NoScriptError)]
        if missing:
            for name, (source, _) in self._scripts.items():
                self._scripts[name] = (source, None)
            again = await self._pipeline([commands[i] for i in missing])
            for i, r in zip(missing, again, strict=True):
                replies[i] = r
        return replies

    async def _pipeline(self, commands: list[tuple]) -> list:
        if len(commands) == 1:  # one command needs no pipeline (a cache hit of a tenant without limits)
            method, *args = commands[0]
            try:
                if method == "script":
                    name, keys, argv = args
                    return [await self._redis.evalsha(await self._sha(name), len(keys), *keys, *argv)]
                return [await getattr(self._redis, method)(*args)]
            except (redis.exceptions.ResponseError, redis.exceptions.NoScriptError) as e:
                return [e]  # as a pipeline gives it: the command's own error
        pipe = self._redis.pipeline(transaction=False)
        for method, *args in commands:
            if method == "script":
                name, keys, argv = args
                pipe.evalsha(await self._sha(name), len(keys), *keys, *argv)
            else:
                getattr(pipe, method)(*args)
        return await pipe.execute(raise_on_error=False)

    def _spend_read(self, counters: Counters) -> list[tuple]:
        return [("mget", self.spend.counter_keys(counters))] if counters and self.spend is not None else []

    def _spent(self, counters: Counters, replies: list) -> list:
        if not counters:
            return []
        if self.spend is None:
            raise RuntimeError("spend counters without Redis spend")
        return spent_of(_ok(replies[-1]))

    async def lookup(self, q: Quota, cache_key: str | None, counters: Counters,
                     miss_tokens: int | None = None) -> Lookup:
        checks = self.quotas.checks(q.tenant, q.key_id, q.tenant_limits, q.key_limits, 0)
        admit_miss = miss_tokens is not None and bool(checks)
        commands = self._spend_read(counters)
        if cache_key:
            if not commands and not checks and (near := self.cache.near(cache_key, q.tenant)) is not None:
                return Lookup(near, QuotaDecision(True))  # nothing to decide in Redis: no round trip
            value_key = self.cache.value_key(cache_key, q.tenant)
            if admit_miss:  # a miss is admitted in the same script: one round trip for the cache and the quota
                miss = self.quotas.checks(q.tenant, q.key_id, q.tenant_limits, q.key_limits, miss_tokens)
                args = ["lookup_admit", *self.quotas.admit_args(checks), *(repr(float(c[3][2])) for c in miss)]
            else:
                args = ["lookup", *self.quotas.admit_args(checks)]
            commands.insert(0, ("script", "quota", [value_key, *(c[2] for c in checks)], args) if checks
                            else ("script", "get", [value_key], []))
        if not commands:
            return Lookup(None, None)
        try:
            replies = await self._run(commands)
            first = _ok(replies[0]) if cache_key else None
        except redis.RedisError as e:
            if checks or counters:  # the quota or a budget cannot be decided: the request fails
                raise
            log.warning("result cache lookup failed (a miss): %s", e)
            return Lookup(self.cache.decoded(cache_key, None), None)
        if not cache_key:
            return Lookup(None, None, self._spent(counters, replies))
        if checks:
            raw, ttl_ms = (first[3], first[4]) if first[0] != 2 and len(first) > 4 else (None, None)
            raw = raw or None  # a miss's answer comes back as false
            if raw is None and admit_miss:  # the miss, admitted (or refused) in that same call
                return Lookup(None, decision_of(checks, first), self._spent(counters, replies), admitted=True)
            decision = decision_of(checks, first) if raw is not None else None
        else:
            (raw, ttl_ms), decision = first, QuotaDecision(True)
        # an entry that does not decode is a miss (logged), though its lookup took a request from the rps
        # buckets: such a request is counted twice there (garbage in the cache is not expected)
        hit = self.cache.decoded(cache_key, raw, q.tenant, ttl_ms)
        return Lookup(hit, decision if hit is not None else None, self._spent(counters, replies))

    async def admit(self, q: Quota, tokens: int, counters: Counters) -> tuple[QuotaDecision, list]:
        checks = self.quotas.checks(q.tenant, q.key_id, q.tenant_limits, q.key_limits, tokens)
        commands = self._spend_read(counters)
        if checks:
            commands.insert(0, ("script", "quota", [c[2] for c in checks], ["admit", *self.quotas.admit_args(checks)]))
        if not commands:
            return QuotaDecision(True), []
        replies = await self._run(commands)
        decision = decision_of(checks, _ok(replies[0])) if checks else QuotaDecision(True)
        return decision, self._spent(counters, replies)

    async def reconcile(self, q: Quota, predicted: int, actual: int) -> None:
        if predicted - actual:
            keys, args = self.quotas.reconcile_call(q.tenant, q.key_id, predicted - actual)
            _ok((await self._run([("script", "quota", keys, args)]))[0])

    async def settle(self, q: Quota, predicted: int, actual: int, charges: Charges, keep: Keep | None) -> None:
        commands, what = [], []
        if predicted - actual:
            keys, args = self.quotas.reconcile_call(q.tenant, q.key_id, predicted - actual)
            commands.append(("script", "quota", keys, args))
            what.append("the quota's true-up")
        if charges and self.spend is not None:
            pipe = _Recorder()
            self.spend.queue_add(pipe, charges)
            commands += pipe.commands
            what += ["the spend"] * len(pipe.commands)
        if keep is not None:
            call = self.cache.put_call(keep.key, keep.value, keep.size_bytes, q.tenant)
            commands.append(("delete", self.cache.value_key(keep.key, q.tenant)) if call is None
                            else ("script", "put", *call))
            what.append("the cached answer")
        if not commands:
            return
        try:
            replies = await self._run(commands)
        except redis.RedisError as e:
            log.warning("the end of a request of key %s (tenant %s) was not stored (%s): %s", q.key_id, q.tenant,
                        ", ".join(dict.fromkeys(what)), e)
            return
        for reply, part in zip(replies, what, strict=True):
            if isinstance(reply, Exception):
                log.warning("%s of key %s (tenant %s) failed: %s", part, q.key_id, q.tenant, reply)

    async def aclose(self) -> None:
        await self._redis.aclose()


class _Recorder:
    """Stands in for a pipeline to record the commands a helper queues on it."""

    def __init__(self):
        self.commands: list[tuple] = []

    def __getattr__(self, method: str):
        return lambda *args: self.commands.append((method, *args))


def _ok(reply):
    if isinstance(reply, Exception):
        raise reply
    return reply
