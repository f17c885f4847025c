"""How a gateway request ends: its commitments (KV ticket, quota charge, spend, Idempotency-Key
claim) settled exactly once, on every path, whatever one step raises; its result kept (cache,
idempotency store) and counted (metrics). ``Settlement`` holds the parts it settles with: the
stores, KV admission, the metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from cascade import errors
from cascade.generation import Finish
from cloud_tier.config import GatewayConfig
from cloud_tier.gateway.pipeline.flight import Flight, estimated_usage
from cloud_tier.gateway.pipeline.metrics import GatewayMetrics
from cloud_tier.gateway.pipeline.state import Keep, Quota
from cloud_tier.gateway.pipeline.stores import Stores
from cloud_tier.gateway.tenants.quotas import Limits
from cloud_tier.gateway.workers.admission import Admission

log = logging.getLogger(__name__)


def outcome_of(error: BaseException) -> str:
    """The outcome label of a request that failed with ``error`` (not one its client left)."""
    if isinstance(error, errors.APIError):
        return f"429_{error.code or ''}" if error.status == 429 else f"{error.status // 100}xx"
    return "5xx"


def tokens_used(f: Flight) -> int:
    """What a served flight is charged: all it used when it finished, or when its client left
    (the prompt and the tokens generated until then); only the tokens it received when the cloud
    failed it."""
    if f.finish is not None:
        return f.finish.prompt_tokens + f.finish.completion_tokens
    if f.error is not None:
        return f.generated_tokens
    return f.prompt_tokens + f.generated_tokens


def _quota(f: Flight) -> Quota:
    """Whose quota a flight's true-up goes to (the limits matter only at admission)."""
    return Quota(f.tenant, f.key.key_id, Limits(), Limits())


def _each(*steps) -> None:
    """Run every step, whatever the others raise (each failure logged)."""
    for step in steps:
        try:
            step()
        except Exception:
            log.exception("a settlement step failed")



class Settlement:
    def __init__(self, config: GatewayConfig, stores: Stores, admission: Admission, metrics: GatewayMetrics,
                 model_id: str):
        self.config = config
        self.quotas = stores.quotas
        self.budgets = stores.budgets
        self.cache = stores.cache
        self.idempotency = stores.idempotency
        self.state = stores.state
        self.admission = admission
        self.metrics = metrics
        self.model_id = model_id

    async def settle(self, f: Flight) -> None:
        """The end of a served flight: free its KV commitment, true up its token charge, keep
        its result (cache, idempotency), count it. Every step is taken whatever another one
        raised: the claim is completed or released and the request counted on every path. What
        goes to the shared state (the quota's true-up, the spend, the cached answer) goes in one
        call (``pipeline.state``: one Redis round trip)."""
        if f.finish is None and f.ended and f.openai:  # a worker that sent no usage: our estimate
            f.finish = Finish("stop", *estimated_usage(f))
        fin, stored = (f.finish if f.error is None else None), None  # a stream that failed after its usage failed
        if fin is None:
            outcome = outcome_of(f.error) if f.error is not None else "499"  # no error: the client left
        else:
            outcome = "ok"  # an answer too large to keep whole is served, not stored (cache, replays)
            stored = {"events": f.events, **({"openai": f.openai} if f.openai else {})} if f.kept else None
        keep: list[Keep] = []
        try:
            _each(lambda: f.ticket is not None and self.admission.release(f.ticket),
                  lambda: f.usage_problem and self.metrics.worker_usage_refused.labels(f.usage_problem).inc(),
                  lambda: fin is not None and self._keep(f, fin, stored, keep))
            try:
                await self._charge(f, keep[0] if keep else None)
            except Exception:
                log.exception("a settlement step failed")
        finally:
            await self.end_claim(f, stored)
            self.count_flight(f, outcome)

    async def _charge(self, f: Flight, keep: Keep | None = None) -> None:
        """True up the quota, count the spend and keep the answer, in one call to the state."""
        used = tokens_used(f)
        completion = f.finish.completion_tokens if f.finish is not None else f.generated_tokens
        try:
            charges = await self.budgets.charges(f.key, f.model or self.model_id, used - completion, completion)
        except Exception:  # the key store is away: the quota and the cache are settled still
            log.exception("spend of key %s (tenant %s) not counted: %d tokens", f.key.key_id, f.tenant, used)
            charges = []
        await self.state.settle(_quota(f), f.predicted_tokens, used, charges, keep)

    def _keep(self, f: Flight, fin: Finish, stored: dict, keep: list) -> None:
        """A finished flight's result for the cache (into ``keep``), its tokens and times into the metrics."""
        try:
            if f.cache_key and stored is not None and not fin.truncated:  # nor one cut at its deadline
                if fin.draft_offered:  # what came of this request's draft is no other request's
                    stored = {**stored, "events": [{k: v for k, v in e.items() if k != "draft"} for e in f.events]}
                size = f.kept_bytes or sum(len(json.dumps(e)) for e in f.events)  # a relayed stream's: its bytes
                keep.append(Keep(f.cache_key, stored, size))
        finally:
            m, t = self.metrics, f.tenant
            m.of(m.tokens_in, t).inc(fin.prompt_tokens)
            m.of(m.tokens_out, t).inc(fin.completion_tokens)
            if fin.draft_offered:  # checked on the wire: 0 <= accepted <= offered <= 64
                m.drafts.inc()
                m.draft_tokens.labels("offered").inc(fin.draft_offered)
                m.draft_tokens.labels("accepted").inc(fin.draft_accepted)
            ttft = (f.first_token_at or time.perf_counter()) - f.arrived
            tpot = ((f.last_token_at - f.first_token_at) / (fin.completion_tokens - 1)
                    if fin.completion_tokens > 1 and f.first_token_at else 0.0)
            m.of(m.ttft, t).observe(ttft)
            m.of(m.tpot, t).observe(tpot)
            if ttft <= self.config.ttft_slo_s and tpot <= self.config.tpot_slo_s:
                m.of(m.goodput, t).inc()

    async def settle_early(self, f: Flight, error: BaseException) -> None:
        """Not served (an APIError before streaming, or cancelled): undo what was taken."""
        f.settled = True
        try:
            _each(lambda: f.ticket is not None and self.admission.release(f.ticket))
            if f.predicted_tokens:
                try:
                    await self.state.reconcile(_quota(f), f.predicted_tokens, 0)
                except Exception:
                    log.exception("a settlement step failed")
        finally:
            await self.end_claim(f)
            self.count_flight(f, "499" if isinstance(error, asyncio.CancelledError) else outcome_of(error))

    async def end_claim(self, f: Flight, result: dict | None = None) -> None:
        """Stop renewing the flight's Idempotency-Key claim, then store its result, or free the key
        when there is none or it cannot be stored (a no-op for a claim another request has taken
        over meanwhile): a retry with the key gets the result or runs again, never waits on it."""
        if f.heartbeat is not None:
            f.heartbeat.cancel()
            f.heartbeat = None
        if f.idem_owner is None:
            return
        owner, f.idem_owner = f.idem_owner, None
        if result is not None:
            try:
                await self.idempotency.acomplete(f.tenant, f.idem_key, result, owner=owner)
                return
            except Exception:
                log.exception("the result of idempotency key %r (tenant %s) was not stored; the key is freed",
                              f.idem_key, f.tenant)
        try:
            await self.idempotency.arelease(f.tenant, f.idem_key, owner=owner)
        except Exception:  # the claim's lease ends it then
            log.exception("idempotency key %r (tenant %s) was not released", f.idem_key, f.tenant)

    def count_flight(self, f: Flight, outcome: str) -> None:
        self.count(f.tenant, f.endpoint, outcome, f.priority_class)

    def count(self, tenant: str, endpoint: str, outcome: str, priority_class: str = "interactive") -> None:
        self.metrics.of(self.metrics.requests, tenant, endpoint, outcome).inc()
        self.metrics.of_class(priority_class, outcome).inc()


