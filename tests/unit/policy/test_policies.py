"""Decision tables for every policy and for their combination (which reason wins)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from cascade.policy.backpressure import CircuitBreaker, exponential_backoff_s, parse_retry_after
from cascade.policy.confidence import Confidence, ConfidenceConfig, low_confidence
from cascade.policy.decide import (
    Decision,
    PolicyConfig,
    RequestSignals,
    after_local,
    decide,
    when_queue_full,
)
from cascade.policy.hard import DifficultyModel, HardConfig, features, fit, is_hard, too_long
from cascade.policy.overflow import LoadSignals, overflow_on_full_queue, overflows, predicted_latency_s
from cascade.policy.refine import wants_refinement
from cascade.policy.session_order import goes_behind_backlog

IDLE = LoadSignals(waiting=0, free_slots=1, service_time_s=2.0, decode_tok_s=40.0, max_tokens=40)
BUSY = LoadSignals(waiting=5, free_slots=0, service_time_s=2.0, decode_tok_s=40.0, max_tokens=40)
CFG = PolicyConfig(hard=HardConfig(max_prompt_tokens=1000, threshold=0.7),
                   confidence=ConfidenceConfig(window=4, min_mean_logprob=-1.0), latency_budget_s=5.0)


def sig(**kw) -> RequestSignals:
    base = dict(prompt_tokens=50, max_tokens=64, n_ctx=2048, load=IDLE)
    return RequestSignals(**{**base, **kw})


@pytest.mark.parametrize("signals,expected", [
    (sig(), Decision("edge", "easy", check_confidence=True)),
    (sig(mode="local", hint="hard", difficulty=0.99), Decision("edge", "local")),
    (sig(upstream=False, difficulty=0.99), Decision("edge", "edge_only")),
    (sig(mode="cloud"), Decision("cloud", "forced")),
    (sig(mode="cloud", prompt_tokens=5000), Decision("cloud", "forced")),  # forced beats too_long
    (sig(prompt_tokens=2000), Decision("cloud", "too_long")),  # prompt + max_tokens > n_ctx
    (sig(prompt_tokens=1200), Decision("cloud", "too_long")),  # over the configured limit
    (sig(prompt_tokens=1200, hint="hard", load=BUSY, difficulty=0.9), Decision("cloud", "too_long")),
    (sig(hint="hard", load=BUSY, difficulty=0.9), Decision("cloud", "hint")),  # hint beats overflow
    (sig(load=BUSY, difficulty=0.9), Decision("cloud", "overflow")),  # overflow beats hard
    (sig(difficulty=0.9), Decision("cloud", "hard")),
    (sig(difficulty=0.5), Decision("edge", "easy", check_confidence=True)),
    (sig(hint="easy", difficulty=0.99, load=BUSY), Decision("edge", "easy", check_confidence=True)),
    (sig(load=BUSY, latency_budget_s=60.0), Decision("edge", "easy", check_confidence=True)),  # own budget
    (sig(mode="cloud", cloud_available=False), Decision("edge", "cloud_unavailable", degraded=True)),
    (sig(difficulty=0.9, cloud_available=False, offline="fail"), Decision("reject", "cloud_unavailable", status=503)),
    (sig(difficulty=0.9, cloud_available=False, offline="queue"), Decision("queue", "cloud_unavailable", status=202)),
    (sig(prompt_tokens=3000, cloud_available=False, offline="queue"),
     Decision("queue", "cloud_unavailable", status=202)),
    (sig(prompt_tokens=3000, cloud_available=False), Decision("reject", "cloud_unavailable", status=503)),
    (sig(difficulty=0.2, cloud_available=False), Decision("edge", "easy", check_confidence=True)),
], ids=lambda v: v.reason if isinstance(v, Decision) else "")
def test_decide(signals, expected):
    assert decide(signals, CFG) == expected


@pytest.mark.parametrize("signals,expected", [
    # a session with requests queued for the cloud: an escalation with offline "queue" waits behind them
    (sig(mode="cloud", offline="queue", session_backlog=True), Decision("queue", "forced", status=202)),
    (sig(difficulty=0.9, offline="queue", session_backlog=True), Decision("queue", "hard", status=202)),
    # ... but not one that may be answered locally or refused, nor one with no backlog
    (sig(mode="cloud", offline="local", session_backlog=True), Decision("cloud", "forced")),
    (sig(mode="cloud", offline="fail", session_backlog=True), Decision("cloud", "forced")),
    (sig(mode="cloud", offline="queue", session_backlog=False), Decision("cloud", "forced")),
    # a request answered locally never waits for the cloud's backlog
    (sig(offline="queue", session_backlog=True), Decision("edge", "easy", check_confidence=True)),
    (sig(mode="local", offline="queue", session_backlog=True), Decision("edge", "local")),
    # with the cloud away the backlog changes nothing: queued for the reason it is away
    (sig(mode="cloud", offline="queue", session_backlog=True, cloud_available=False),
     Decision("queue", "cloud_unavailable", status=202)),
], ids=lambda v: f"{v.tier}-{v.reason}" if isinstance(v, Decision) else "")
def test_session_order(signals, expected):
    assert decide(signals, CFG) == expected


@pytest.mark.parametrize("backlog,offline,expected", [
    (True, "queue", True), (True, "local", False), (True, "fail", False), (False, "queue", False),
])
def test_goes_behind_backlog(backlog, offline, expected):
    assert goes_behind_backlog(backlog, offline) is expected


@pytest.mark.parametrize("decision,signals,expected", [
    # an easy request the full local queue refused: the cloud takes it
    (Decision("edge", "easy"), sig(), Decision("cloud", "overflow")),
    # kept local on purpose, degraded after a failed escalation, or no cloud: the queue's 429
    (Decision("edge", "local"), sig(mode="local"), Decision("reject", "queue_full", status=429)),
    (Decision("edge", "cloud_unavailable", degraded=True), sig(cloud_available=False),
     Decision("reject", "queue_full", status=429)),
    (Decision("edge", "edge_only"), sig(upstream=False), Decision("reject", "queue_full", status=429)),
    (Decision("edge", "easy"), sig(cloud_available=False), Decision("reject", "queue_full", status=429)),
    (Decision("edge", "easy"), sig(upstream=False), Decision("reject", "queue_full", status=429)),
])
def test_when_queue_full(decision, signals, expected):
    assert when_queue_full(decision, signals) == expected


@pytest.mark.parametrize("reason,upstream,available,expected", [
    ("easy", True, True, True), ("easy", True, False, False), ("easy", False, True, False),
    ("local", True, True, False), ("cloud_unavailable", True, True, False),
])
def test_overflow_on_full_queue(reason, upstream, available, expected):
    assert overflow_on_full_queue(reason, upstream, available) is expected


@pytest.mark.parametrize("degraded,requested,upstream,expected", [
    (True, True, True, True), (False, True, True, False), (True, False, True, False),
    (True, True, False, False),
])
def test_wants_refinement(degraded, requested, upstream, expected):
    assert wants_refinement(degraded, requested, upstream) is expected


def test_no_confidence_check_without_thresholds_or_outside_auto():
    assert decide(sig(), PolicyConfig()).check_confidence is False
    assert decide(sig(mode="local"), CFG).check_confidence is False


@pytest.mark.parametrize("prompt,max_tokens,n_ctx,limit,expected", [
    (100, 100, 2048, 0, False), (2000, 100, 2048, 0, True), (1948, 100, 2048, 0, False),
    (600, 10, 2048, 500, True), (500, 10, 2048, 500, False),
])
def test_too_long(prompt, max_tokens, n_ctx, limit, expected):
    assert too_long(prompt, max_tokens, n_ctx, HardConfig(max_prompt_tokens=limit)) is expected


@pytest.mark.parametrize("load,budget,expected", [
    (IDLE, 5.0, False),  # 1 s of generation
    (IDLE, 0.5, True),
    (BUSY, 5.0, True),  # 6 x 2 s queued + 1 s
    (BUSY, None, False), (BUSY, 0.0, False),  # no budget, no overflow
])
def test_overflow(load, budget, expected):
    assert overflows(load, budget) is expected


def test_predicted_latency_counts_the_queue_only_without_a_free_slot():
    assert predicted_latency_s(IDLE) == pytest.approx(1.0)
    assert predicted_latency_s(BUSY) == pytest.approx(13.0)


@pytest.mark.parametrize("logprobs,entropies,config,expected", [
    ([-0.1] * 4, [0.5] * 4, ConfidenceConfig(min_mean_logprob=-1.0), False),
    ([-2.0] * 4, [0.5] * 4, ConfidenceConfig(min_mean_logprob=-1.0), True),
    ([-0.1, -0.1, -5.0, -0.1], [0.5] * 4, ConfidenceConfig(min_token_logprob=-4.0), True),
    ([-0.1, -0.1, -5.0, -0.1], [0.5] * 4, ConfidenceConfig(min_mean_logprob=-2.0), False),
    ([-0.1] * 4, [3.0] * 4, ConfidenceConfig(max_mean_entropy=2.0), True),
    ([-9.0] * 4, [9.0] * 4, ConfidenceConfig(), False),  # no thresholds: never
    ([], [], ConfidenceConfig(min_mean_logprob=-1.0), False),  # nothing to judge
])
def test_low_confidence(logprobs, entropies, config, expected):
    c = Confidence(window=4)
    for lp, h in zip(logprobs, entropies, strict=True):
        c.add(lp, h)
    assert low_confidence(c, config) is expected


def test_confidence_looks_only_at_the_first_k_tokens():
    c = Confidence(window=2)
    for lp in (-0.1, -0.1, -9.0):
        c.add(lp, 0.0)
    assert c.full and c.n == 2 and c.min_logprob == -0.1


@pytest.mark.parametrize("mean,available,expected", [
    (-0.1, True, None),
    (-3.0, True, Decision("cloud", "low_confidence")),
    (-3.0, False, Decision("edge", "low_confidence_cloud_unavailable", degraded=True)),
])
def test_after_local(mean, available, expected):
    c = Confidence(window=4)
    for _ in range(4):
        c.add(mean, 0.1)
    assert after_local(c, ConfidenceConfig(window=4, min_mean_logprob=-1.0), available) == expected


def test_circuit_opens_on_429_until_retry_after_then_probes_once_and_closes_on_success():
    now = [100.0]
    cb = CircuitBreaker(clock=lambda: now[0])
    assert cb.state == "closed" and cb.allow()
    cb.failure("429", retry_after_s=5.0)
    assert cb.state == "open" and not cb.allow() and cb.retry_after_s() == pytest.approx(5.0)
    now[0] += 5.0
    assert cb.state == "half_open"
    assert cb.allow() and not cb.allow()  # one probe at a time
    cb.success()
    assert cb.state == "closed" and cb.allow()


def test_circuit_backs_off_exponentially_without_retry_after():
    now = [0.0]
    cb = CircuitBreaker(base_backoff_s=1.0, max_backoff_s=8.0, clock=lambda: now[0])
    waits = []
    for _ in range(5):
        cb.failure("unreachable")
        waits.append(cb.retry_after_s())
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0]


def test_features_and_a_fitted_difficulty_model_separate_easy_from_hard():
    easy = ["What is the capital of France?", "Say hello.", "What color is the sky?", "Name a fruit."] * 5
    hard = ["Explain step by step why the integral of x^2 is x^3/3 and prove it.",
            "Write a Python function `def merge(a, b):` that merges two sorted lists; analyze its complexity.",
            "Compare and evaluate three designs for a distributed cache; explain the trade-offs.",
            "Solve the equation 3x + 7 = 22 and explain each step."] * 5
    rows = [features(t) for t in easy + hard]
    model = fit(rows, [0] * len(easy) + [1] * len(hard))
    assert max(model.score(features(t)) for t in easy) < min(model.score(features(t)) for t in hard)
    assert DifficultyModel.from_json(model.to_json()) == model
    assert is_hard(0.8, HardConfig(threshold=0.7)) and not is_hard(0.8, HardConfig())
    assert math.isclose(DifficultyModel().score(features("x")), 0.5)


# -- back-pressure arithmetic after a long outage (issue 12, item 5) ---------------------------

def test_the_breaker_survives_any_number_of_failures():
    clock = [0.0]
    b = CircuitBreaker(base_backoff_s=1.0, max_backoff_s=60.0, clock=lambda: clock[0])
    for _ in range(5000):  # 2 ** 1024 overflowed a float at the 1,025th consecutive failure
        b.failure("unreachable")
    assert b.failures == 5000 and b.state == "open" and b.retry_after_s() == 60.0


@pytest.mark.parametrize("retry_after,expected", [
    (5.0, 5.0), (0.0, 0.0), (-3.0, 0.0), (math.inf, 3600.0), (1e400, 3600.0), (math.nan, 1.0),
])
def test_a_peers_retry_after_is_clamped(retry_after, expected):
    b = CircuitBreaker(base_backoff_s=1.0, clock=lambda: 100.0)
    b.failure("429", retry_after)
    assert b.retry_after_s() == expected and math.isfinite(b.open_until)


@pytest.mark.parametrize("value,expected", [
    ("120", 120.0), (" 7 ", 7.0), ("0", 0.0), ("-5", 0.0), ("inf", 3600.0), ("1e400", 3600.0), ("nan", None),
    ("Wed, 21 Oct 2015 07:28:00 GMT", 90.0),  # an HTTP-date: 90 s after `now` below
    ("Wed, 21 Oct 2015 07:00:00 GMT", 0.0),  # in the past: now
    ("Wed, 21 Oct 2015 07:28:00", None),  # no zone: not an HTTP-date
    ("soon", None), ("", None), (None, None),
])
def test_retry_after_is_read_in_both_forms(value, expected):
    now = 1445412390.0  # 2015-10-21 07:26:30 GMT
    assert parse_retry_after(value, now=now) == expected


def test_exponential_backoff_is_finite_and_capped():
    assert exponential_backoff_s(1, 0.5, 60) == 0.5 and exponential_backoff_s(3, 0.5, 60) == 2.0
    assert exponential_backoff_s(10**6, 0.5, 60) == 60 and exponential_backoff_s(0, 0.5, 60) == 0.5


def test_a_refusal_is_its_own_state_on_a_slow_schedule():
    now = [0.0]
    b = CircuitBreaker(base_backoff_s=1.0, max_backoff_s=4.0, refused_backoff_s=30.0, clock=lambda: now[0])
    b.refusal("refused: HTTP 401")
    assert b.state == "refused" and not b.available and b.retry_after_s() == 30.0
    now[0] = 30.0
    assert b.state == "half_open" and b.allow() and not b.available
    b.refusal("refused: HTTP 401")
    assert b.retry_after_s() == 60.0  # doubling, past the outage cap of 4 s
    now[0] = 100.0
    b.allow()
    b.success()
    assert b.state == "closed" and not b.refused and b.available
    b.failure("HTTP 503")
    assert b.state == "open" and not b.refused


def test_an_abandoned_probe_frees_the_half_open_slot():
    now = [0.0]
    b = CircuitBreaker(clock=lambda: now[0])
    b.failure("unreachable")
    now[0] = 5.0
    assert b.allow() and not b.allow()  # one probe at a time
    b.abandon()  # the probe's caller was cancelled: nothing learnt
    assert b.allow()


def test_decisions_name_a_refusal_apart_from_an_outage():
    s = RequestSignals(prompt_tokens=10, max_tokens=10, n_ctx=512, mode="cloud", cloud_available=False,
                       cloud_refused=True)
    assert decide(s, PolicyConfig()) == Decision("edge", "cloud_refused", degraded=True)
    assert decide(replace(s, offline="queue"), PolicyConfig()).reason == "cloud_refused"
    assert decide(replace(s, offline="fail"), PolicyConfig()) == Decision("reject", "cloud_refused", status=503)
    assert decide(replace(s, cloud_refused=False), PolicyConfig()).reason == "cloud_unavailable"
