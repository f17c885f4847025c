"""Where a request is answered: the cascade's decision (cascade/policy) wired to the local
backend and the upstream client. Routing happens before any byte goes to the app, so the
headers (``X-Cascade-Tier``, ``X-Cascade-Reason``) are always true: a cloud request is started
(and its refusal known) first, and in auto mode the local answer's first K tokens are held back
and judged before anything of it is released. With a router (``[cascade] router``, calibrated for
the served model: ``routing.RouterGate``) its stage 1 may escalate "hard" before generating, and
its stage 2 judges the held-back tokens instead of the confidence thresholds."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from cascade import errors, wire
from cascade.calibration import load_router
from cascade.generation import Finish, TokenEvent
from cascade.policy.confidence import Confidence, ConfidenceConfig
from cascade.policy.decide import (
    Decision,
    PolicyConfig,
    RequestSignals,
    after_check,
    after_local,
    after_router,
    decide,
    when_queue_full,
)
from cascade.policy.hard import DifficultyModel, HardConfig, features
from cascade.policy.overflow import LoadSignals
from cascade.policy.refine import wants_refinement
from cascade.policy.router import prompt_features
from cascade.policy.session_order import goes_behind_backlog
from cascade.structured.contract import TEXT, OutputContract
from cascade.structured.validate import problem
from edge_agent.config import CascadeConfig
from edge_agent.drafts import draft_of
from edge_agent.server.outbox import Outbox
from edge_agent.server.routing import RouterGate
from edge_agent.server.service import EdgeService, LocalJob, LocalRun
from edge_agent.upstream import Upstream, UpstreamRefused, UpstreamUnavailable

log = logging.getLogger(__name__)
# the job's refusals of a contract the device cannot enforce (a cloud may: the request goes up)
UNSERVABLE = ("schema_unsupported", "unsupported_schema_keyword", "invalid_schema")


def policy_config(c: CascadeConfig) -> PolicyConfig:
    model = DifficultyModel()
    if c.difficulty_model:
        model = DifficultyModel.from_json(wire.loads(wire.read_file(Path(c.difficulty_model).expanduser(), 1 << 20),
                                                     limit=1 << 20))
    return PolicyConfig(
        hard=HardConfig(max_prompt_tokens=c.max_prompt_tokens, threshold=c.difficulty_threshold, model=model),
        confidence=ConfidenceConfig(window=c.hold_tokens, min_mean_logprob=c.min_mean_logprob,
                                    min_token_logprob=c.min_token_logprob, max_mean_entropy=c.max_mean_entropy),
        latency_budget_s=c.latency_budget_s,
        router=load_router(Path(c.router).expanduser()) if c.router else None)


@dataclass
class Routed:
    """A request's answer, as events, and who gives it and why."""

    events: AsyncIterator[TokenEvent | Finish]
    tier: str
    reason: str
    degraded: bool = False
    model: str | None = None  # the cloud's model name when it answers
    info: dict = field(default_factory=dict)
    extra_headers: dict = field(default_factory=dict)
    local: LocalRun | None = None  # the local generation under ``events``, when it answers here

    async def aclose(self) -> None:
        """Drop the answer unread: a local one gives its slot back even if it never started."""
        if self.local is not None:
            await self.local.aclose()
        await self.events.aclose()

    @property
    def headers(self) -> dict[str, str]:
        h = {"X-Cascade-Tier": self.tier, "X-Cascade-Reason": self.reason, **self.extra_headers}
        if self.degraded:
            h["X-Cascade-Degraded"] = "true"
        return h

    def __post_init__(self):
        # the ``cascade`` field of the final chunk / body; the same dict the formatter holds, so
        # what is measured while streaming (confidence) lands in it
        self.cascade_field = {"tier": self.tier, "reason": self.reason, "degraded": self.degraded, **self.info}


@dataclass
class Queued:
    """A request stored for the cloud (202 Accepted): the app polls ``location``."""

    id: str
    reason: str

    @property
    def location(self) -> str:
        return f"/v1/requests/{self.id}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Location": self.location, "X-Cascade-Tier": "queue", "X-Cascade-Reason": self.reason}

    def body(self) -> dict:
        return {"id": self.id, "object": "cascade.request", "state": "queued", "location": self.location,
                "cascade": {"tier": "queue", "reason": self.reason, "degraded": False}}


async def _tracked(events: AsyncIterator, window: int, routed_field: dict) -> AsyncIterator:
    """Pass events through, recording the confidence of the first ``window`` tokens."""
    conf = Confidence(window=window)
    try:
        async for ev in events:
            if isinstance(ev, TokenEvent) and not conf.full:
                conf.add(ev.logprob, ev.entropy)
                routed_field["confidence"] = conf.as_dict()
            yield ev
    finally:
        await events.aclose()


async def _hold(events, conf: Confidence, whole: bool) -> list:
    """The local answer's first events, read before anything is released: until ``conf`` is full
    (its first K tokens), or the whole answer when ``whole``."""
    held: list = []
    try:
        async for ev in events:
            held.append(ev)
            if isinstance(ev, Finish):
                break
            if not conf.full:
                conf.add(ev.logprob, ev.entropy)
            if conf.full and not whole:
                break
    except BaseException:
        await events.aclose()
        raise
    return held


def _text(held: list) -> str:
    return "".join(ev.text for ev in held)  # the tokens' released text, and the finish's rest


async def _chain(held: list, rest: AsyncIterator) -> AsyncIterator:
    try:
        for ev in held:
            yield ev
            if isinstance(ev, Finish):
                return
        async for ev in rest:
            yield ev
    finally:
        await rest.aclose()


class Escalator:
    def __init__(self, config: CascadeConfig, service: EdgeService, upstream: Upstream | None, outbox: Outbox):
        self.config = config
        self.policy = policy_config(config)
        self.service = service
        self.upstream = upstream
        self.outbox = outbox
        self.gate = RouterGate(service.description.name, service.description.path)
        self.gate.active(self.policy.router)  # judged (and the model hashed) now, not on a first request

    @property
    def router(self):
        """The configured router when it was calibrated for the served model, else None."""
        return self.gate.active(self.policy.router)

    def signals(self, req, job: LocalJob | None, prompt_text: str, prompt_tokens: int,
                prompt_feats: dict[str, float] | None = None, unservable: bool = False) -> RequestSignals:
        """``prompt_feats``: the router's prompt features, when a router is in effect."""
        opts = req.cascade
        svc = self.service
        pool = svc.pool
        max_tokens = job.options.max_tokens if job else (req.token_limit() or 0)
        load = LoadSignals(waiting=pool.waiting, free_slots=pool.size - pool.busy, service_time_s=pool.mean_service_s,
                           decode_tok_s=svc.decode_tok_s, max_tokens=max_tokens)
        router = self.router if prompt_feats is not None else None
        return RequestSignals(
            routed_hard=router is not None and router.before(prompt_feats), unservable=unservable,
            router_judges=router is not None,
            prompt_tokens=prompt_tokens, max_tokens=max_tokens, n_ctx=svc.description.n_ctx,
            mode=(opts.mode if opts and opts.mode else self.config.mode),
            offline=(opts.offline if opts and opts.offline else self.config.offline),
            hint=opts.hint if opts else None,
            difficulty=(self.policy.hard.model.score(features(prompt_text))  # a router replaces it
                        if self.policy.hard.model.weights and router is None else 0.0),
            load=load, latency_budget_s=opts.latency_budget_s if opts else None,
            upstream=self.upstream is not None,
            cloud_available=self.upstream.available if self.upstream else False,
            cloud_refused=self.upstream.refused if self.upstream else False)

    async def route(self, req, endpoint: str, body: dict, make_job, prompt_text: str,
                    session: str | None = None, app_key: str | None = None,
                    contract: OutputContract = TEXT) -> Routed | Queued:
        """``make_job()`` builds the local job (it raises 400 when the prompt cannot run here, or
        its output contract cannot be enforced here: then, with a cloud, it escalates).
        A request the cloud should answer but cannot reach is queued (``Queued``) when its
        offline policy says so. Everything the request could be refused for is checked before a
        local slot is reserved; a reservation is given back on every exit."""
        self.outbox.check_callback(req.cascade.callback_url if req.cascade else None)
        if app_key is not None and (earlier := await self.outbox.earlier(body, app_key)) is not None:
            return Queued(earlier.id, earlier.reason)  # the app's retry of a request queued under its key
        job, too_long_locally, unservable, n_prompt = (await asyncio.to_thread(self._job, make_job)
                                                       if req.costly_to_plan() else self._job(make_job))
        feats = prompt_features(prompt_text) if self.router is not None else None
        signals = self.signals(req, job, prompt_text, n_prompt, feats, unservable)
        if session and goes_behind_backlog(True, signals.offline):  # the rule could apply: ask the queue
            backlog = await asyncio.to_thread(self.outbox.queue.session_pending, session)
            signals = replace(signals, session_backlog=backlog)
        decision = decide(signals, self.policy)
        log.debug("%s request: %s (%s); prompt %d tokens, max_tokens %d, mode %s, slots %d busy / %d waiting, "
                  "cloud %s", endpoint, decision.tier, decision.reason, n_prompt, signals.max_tokens, signals.mode,
                  self.service.pool.busy, self.service.pool.waiting,
                  self.upstream.breaker.state if self.upstream else "none")
        if decision.tier == "cloud":
            try:
                return await self._cloud(endpoint, body, decision.reason, app_key=app_key)
            except UpstreamUnavailable as e:
                decision = decide(replace(signals, cloud_available=False, cloud_refused=e.refused), self.policy)
                log.warning("escalation failed (%s); %s: %s", e, decision.tier, decision.reason)
        if decision.tier == "queue":
            self._count(decision)
            return Queued(await self.outbox.submit(endpoint, body, decision.reason, session, req.cascade, app_key),
                          decision.reason)
        if decision.tier == "reject":
            self._count(decision)
            retry = self.upstream.breaker.retry_after_s() if self.upstream else 1.0
            what = ("refuses this device's key" if decision.reason == "cloud_refused" else "cannot be reached")
            raise errors.APIError(decision.status, f"The cloud tier {what} and this request cannot be "
                                  "answered on the device.", "server_error", code=decision.reason,
                                  headers={"Retry-After": str(max(1, round(retry))),
                                           "X-Cascade-Reason": decision.reason})
        if job is None:  # too long for this device or a contract it cannot enforce, and kept here (mode local)
            raise too_long_locally
        routed = await self._local(job, decision, signals, endpoint, body, app_key, feats)
        if wants_refinement(routed.degraded, bool(req.cascade and req.cascade.refine), signals.upstream):
            # the app takes the degraded local answer now and the cloud's when it comes
            try:
                refinement = Queued(await self.outbox.submit(endpoint, body, "refine", session, req.cascade),
                                    "refine")
            except BaseException:
                await routed.aclose()  # the local answer will not be read: its slot goes back
                raise
            routed.cascade_field["refinement"] = refinement.location
            routed.extra_headers["X-Cascade-Refinement"] = refinement.location
        return routed

    def _job(self, make_job) -> tuple[LocalJob | None, errors.APIError | None, bool, int]:
        """(the local job, why there is none, whether that is a contract the device cannot enforce,
        the prompt's length): a prompt too long or a contract unenforceable here is no error while a
        cloud could take it."""
        try:
            job = make_job()
            return job, None, False, len(job.prompt_tokens)
        except errors.APIError as e:
            if e.code not in ("context_length_exceeded", *UNSERVABLE) or self.upstream is None:
                raise
            unservable = e.code in UNSERVABLE
            return None, e, unservable, 0 if unservable else self.service.description.n_ctx

    async def _cloud(self, endpoint: str, body: dict, reason: str, draft: dict | None = None,
                     app_key: str | None = None) -> Routed:
        try:
            esc = await self.upstream.escalate(endpoint, body, reason, draft, app_key=app_key)
        except UpstreamRefused as e:
            raise errors.APIError(e.status, f"The cloud tier refused the request: {e.body[:300]}",
                                  code="upstream_refused") from e
        self._count(Decision("cloud", reason))
        return Routed(esc.events, "cloud", reason, model=esc.model or None)

    async def _local(self, job: LocalJob, decision: Decision, signals: RequestSignals, endpoint: str,
                     body: dict, app_key: str | None = None, feats: dict[str, float] | None = None) -> Routed:
        svc = self.service
        try:
            reservation = svc.admit()
        except errors.APIError:  # the queue is full: the cloud may take it instead
            full = when_queue_full(decision, replace(signals, cloud_available=bool(
                self.upstream and self.upstream.available)))
            if full.tier != "cloud":
                raise
            try:
                return await self._cloud(endpoint, body, full.reason, app_key=app_key)
            except UpstreamUnavailable:
                raise errors.too_many_requests("The edge agent's queue is full and the cloud cannot be "
                                               "reached; retry later.", svc.pool.predicted_wait_s(),
                                               "queue_full") from None
        events = svc.run(job, reservation)
        # a structured answer a cloud could give instead is held whole and checked before release
        check_answer = job.contract.structured and self.upstream is not None and decision.reason == "easy"
        if not (decision.check_confidence or check_answer) or self.upstream is None:
            self._count(decision)
            routed = Routed(events, "edge", decision.reason, decision.degraded, local=events)
            routed.events = _tracked(events, self.policy.confidence.window, routed.cascade_field)
            return routed
        started = time.perf_counter()
        router = self.router if feats is not None else None
        conf = Confidence(window=router.window if router else self.policy.confidence.window)
        held = await _hold(events, conf, whole=check_answer)
        svc.metrics.hold_back.observe(time.perf_counter() - started)
        info = {"confidence": conf.as_dict()}
        after = None
        if decision.check_confidence:
            after = (after_router(router, feats, conf, self.upstream.available) if router
                     else after_local(conf, self.policy.confidence, self.upstream.available))
        if check_answer and (after is None or after.tier != "cloud") and (
                why := await asyncio.to_thread(problem, job.contract, _text(held))):
            after, info["schema_problem"] = after_check(why, self.upstream.available), why[:300]
        if after is not None and after.tier == "cloud":
            # the cloud verifies the device's low-confidence draft; an answer that broke its contract is none
            draft = (draft_of(held, svc.description.tokenizer, job.options.temperature == 0)
                     if after.reason == "low_confidence" else None)
            try:
                routed = await self._cloud(endpoint, body, after.reason, draft, app_key)
            except (UpstreamUnavailable, errors.APIError) as e:
                # the cloud cannot take it or refused it (a 4xx): the local answer the app could
                # have had all along is still here, so it gets that rather than an error
                log.warning("%s escalation failed: %s; answering locally", after.reason, e)
                after = (after_check(info["schema_problem"], cloud_available=False) if after.reason == "schema_invalid"
                         else after_local(conf, self.policy.confidence, cloud_available=False))
            except BaseException:
                await events.aclose()
                raise
            else:
                await events.aclose()  # nothing of the local answer was released
                routed.cascade_field.update(info)
                return routed
        final = after or decision
        self._count(final)
        return Routed(_chain(held, events), "edge", final.reason, final.degraded, info=info, local=events)

    def _count(self, d: Decision) -> None:
        self.service.metrics.decisions.labels(d.tier, d.reason).inc()


