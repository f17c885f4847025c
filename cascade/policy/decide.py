"""The one decision: which tier answers, and the reason code that names why.

Precedence, first match wins:
  1. ``mode: local``                 -> edge  "local"       (never leaves the device)
  2. no upstream configured          -> edge  "edge_only"
  3. escalation, in order:  ``mode: cloud`` "forced" > prompt too long "too_long" > a structured output
     (response_format, tools) the device cannot enforce "schema_unsupported" > app hint
     "hint" > queue overflow "overflow" > learned difficulty or the router's stage 1 "hard"
  4. an escalation while the cloud is available -> cloud, with its reason; but behind its
     session's backlog (queue, 202) when that session has requests queued for the cloud and
     its offline policy is ``queue`` (``session_order``)
  5. an escalation while the cloud is unavailable (circuit open): by the offline policy,
     ``queue`` -> queue "cloud_unavailable" (202: stored, delivered when the cloud returns),
     ``local`` -> edge "cloud_unavailable" degraded (if the prompt fits locally), else reject 503;
     the reason is "cloud_refused" instead when the cloud refuses this device (401/403)
  6. otherwise                       -> edge  "easy", its answer checked for low confidence
After a local answer (or its first K tokens): ``after_local`` escalates "low_confidence" (with a
router, ``after_router``: its stage 2 decides instead of the confidence thresholds); a whole local
answer that breaks its output contract (its schema, its tools): ``after_check`` escalates "schema_invalid".
When the local queue is full: ``when_queue_full`` (overflow to the cloud, or the queue's 429).
A degraded local answer may also be queued for the cloud: ``refine.wants_refinement``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cascade.policy.confidence import Confidence, ConfidenceConfig, low_confidence
from cascade.policy.hard import HardConfig, is_hard, too_long
from cascade.policy.overflow import LoadSignals, overflow_on_full_queue, overflows
from cascade.policy.router import Router, uncertainty_features
from cascade.policy.session_order import goes_behind_backlog


@dataclass(frozen=True)
class PolicyConfig:
    hard: HardConfig = field(default_factory=HardConfig)
    confidence: ConfidenceConfig = field(default_factory=ConfidenceConfig)
    latency_budget_s: float = 0.0  # default per-request budget for the overflow rule; 0: none
    router: Router | None = None  # the two-stage router (used only while it matches the served model)


@dataclass(frozen=True)
class RequestSignals:
    prompt_tokens: int
    max_tokens: int
    n_ctx: int
    mode: str = "auto"  # auto | local | cloud
    offline: str = "local"  # queue | local | fail
    hint: str | None = None  # the app's own "easy" | "hard"
    difficulty: float = 0.0  # DifficultyModel score in [0, 1]
    load: LoadSignals | None = None
    latency_budget_s: float | None = None
    upstream: bool = True  # an upstream is configured
    cloud_available: bool = True  # the back-pressure circuit lets a request through
    cloud_refused: bool = False  # not available because the cloud refuses this device (401/403)
    session_backlog: bool = False  # the request's session has requests queued for the cloud
    routed_hard: bool = False  # the router's stage 1 is sure the cloud answers better
    router_judges: bool = False  # a router's stage 2 will judge the hold-back tokens
    unservable: bool = False  # its output contract (schema, tools) cannot be enforced on the device


@dataclass(frozen=True)
class Decision:
    tier: str  # "edge" | "cloud" | "queue" | "reject"
    reason: str
    degraded: bool = False
    check_confidence: bool = False  # a local answer may still escalate on low confidence
    status: int = 0  # for "reject" and "queue": the HTTP status


def escalation_reason(s: RequestSignals, config: PolicyConfig) -> str | None:
    if s.mode == "cloud":
        return "forced"
    if too_long(s.prompt_tokens, s.max_tokens, s.n_ctx, config.hard):
        return "too_long"
    if s.unservable:
        return "schema_unsupported"
    if s.hint == "hard":
        return "hint"
    if s.hint == "easy":
        return None
    budget = s.latency_budget_s if s.latency_budget_s is not None else config.latency_budget_s
    if s.load is not None and overflows(s.load, budget):
        return "overflow"
    if s.routed_hard or is_hard(s.difficulty, config.hard):
        return "hard"
    return None


def decide(s: RequestSignals, config: PolicyConfig) -> Decision:
    if s.mode == "local":
        return Decision("edge", "local")
    if not s.upstream:
        return Decision("edge", "edge_only")
    reason = escalation_reason(s, config)
    if reason is None:
        return Decision("edge", "easy", check_confidence=s.mode == "auto" and (config.confidence.enabled
                                                                               or s.router_judges))
    if s.cloud_available:
        if goes_behind_backlog(s.session_backlog, s.offline):
            return Decision("queue", reason, status=202)
        return Decision("cloud", reason)
    why = "cloud_refused" if s.cloud_refused else "cloud_unavailable"
    if s.offline == "queue":
        return Decision("queue", why, status=202)
    fits_locally = s.prompt_tokens + 1 <= s.n_ctx and not s.unservable
    if s.offline == "local" and fits_locally:
        return Decision("edge", why, degraded=True)
    return Decision("reject", why, status=503)


def after_local(conf: Confidence, config: ConfidenceConfig, cloud_available: bool) -> Decision | None:
    """Escalate a local answer (or its first K tokens) whose confidence is too low; None keeps it.
    With the cloud unavailable the local answer stands, marked degraded."""
    if not low_confidence(conf, config):
        return None
    if cloud_available:
        return Decision("cloud", "low_confidence")
    return Decision("edge", "low_confidence_cloud_unavailable", degraded=True)


def after_router(router: Router, prompt: dict[str, float], conf: Confidence, cloud_available: bool
                 ) -> Decision | None:
    """The router's stage 2 on the hold-back tokens: escalate "low_confidence" when it predicts the
    cloud answers better; None keeps the local answer (degraded as ``after_local`` when the cloud
    is unavailable)."""
    if conf.n == 0:
        return None
    unc = uncertainty_features(conf.logprobs, conf.entropies, conf.window, finished=not conf.full)
    if not router.after(prompt, unc):
        return None
    if cloud_available:
        return Decision("cloud", "low_confidence")
    return Decision("edge", "low_confidence_cloud_unavailable", degraded=True)


def after_check(problem: str, cloud_available: bool) -> Decision | None:
    """A whole local answer that breaks its output contract (``problem``: why) escalates
    "schema_invalid"; None keeps it. With the cloud unavailable the app gets it, marked degraded."""
    if not problem:
        return None
    if cloud_available:
        return Decision("cloud", "schema_invalid")
    return Decision("edge", "schema_invalid_cloud_unavailable", degraded=True)


def when_queue_full(decision: Decision, s: RequestSignals) -> Decision:
    """The local queue refused a request ``decision`` would answer here: the cloud takes it
    ("overflow"), or it is refused with the queue's 429 ("queue_full")."""
    if overflow_on_full_queue(decision.reason, s.upstream, s.cloud_available):
        return Decision("cloud", "overflow")
    return Decision("reject", "queue_full", status=429)
