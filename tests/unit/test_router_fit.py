"""Fitting the router on a synthetic set where the gap is known: carried by one uncertainty
signal among noise, the fitted model finds it (held-out APGR and AUC above bounds) and ignores
the noise; the two thresholds hit the target escalation rate on the fitting set."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cascade.eval import calibration as cal
from cascade.eval.router_fit import fit_router, labels, logistic, sample_features
from cascade.eval.scoring import Task
from cascade.policy.router import PROMPT_FEATURES

K = 8


def _auc(scores, y) -> float:
    pos, neg = [s for s, t in zip(scores, y, strict=True) if t], [s for s, t in zip(scores, y, strict=True) if not t]
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def synthetic(n: int, seed: int, carrier: str = "lp_min") -> list[cal.Sample]:
    """The edge is wrong (and the cloud right) when its least sure token was unsure; prompts and
    the other token statistics are noise."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        noise = [rng.uniform(-1.0, 0.0) for _ in range(K)]
        worst = rng.uniform(-6.0, 0.0)
        lps = [*noise[:-1], worst] if carrier == "lp_min" else noise
        edge_wrong = rng.random() < 1 / (1 + np.exp(2.5 * (worst + 3.0)))
        vocab = ["alpha", "beta", "gamma", "delta", "12", "+", "?"]
        words = " ".join(rng.choice(vocab) for _ in range(rng.randint(3, 30)))
        s = cal.Sample(Task(f"{words} {i}", "x", "fact"),
                       confidence={"tokens": K, "logprobs": rng.sample(lps, K),
                                   "entropies": [rng.uniform(0, 2) for _ in range(K)]})
        s.edge_score, s.cloud_score = (0.0, 1.0) if edge_wrong else (1.0, 1.0)
        out.append(s)
    return out


def test_the_fitted_router_finds_the_signal_that_carries_the_gap_and_ignores_noise():
    fit, held = synthetic(400, 0), synthetic(400, 1)
    router, _ = fit_router(fit, target=0.3, window=K, edge_model="m")
    risk = [router.stage2.score(sample_features(s, K)) for s in held]
    q_e, q_c = cal.quality(held, [False] * len(held)), cal.quality(held, [True] * len(held))
    oracle = cal.apgr(cal.curve(held, [s.cloud_score - s.edge_score for s in held]), q_e, q_c)
    assert cal.apgr(cal.curve(held, risk), q_e, q_c) > 0.9 * oracle > 0.6  # random routing: 0.5
    assert _auc(risk, labels(held)) > 0.85
    w = router.stage2.weights
    assert w["lp_min"] < 0 and abs(w["lp_min"]) == max(abs(v) for v in w.values())
    # what the noise features add to the logit varies far less than what the signal adds
    st = router.stage2

    def part(names, f):
        return sum(w[k] * (f[k] - st.mean[k]) / st.scale[k] for k in names)
    feats = [sample_features(s, K) for s in held]
    noise = np.std([part((*PROMPT_FEATURES, "ent_mean", "ent_max"), f) for f in feats])
    signal = np.std([part(("lp_min", "lp_p10", "lp_p25", "lp_median", "lp_mean"), f) for f in feats])
    assert noise < 0.25 * signal


def test_without_a_signal_the_router_is_no_better_than_random():
    fit, held = synthetic(400, 2, carrier="none"), synthetic(400, 3, carrier="none")
    router, _ = fit_router(fit, target=0.3, window=K, edge_model="m")
    risk = [router.stage2.score(sample_features(s, K)) for s in held]
    assert 0.35 < _auc(risk, labels(held)) < 0.65


@pytest.mark.parametrize("target", [0.1, 0.3, 0.5])
def test_the_two_thresholds_hit_the_target_rate_on_the_fitting_set(target):
    fit = synthetic(300, 4)
    router, _ = fit_router(fit, target=target, window=K, edge_model="m")
    feats = [sample_features(s, K) for s in fit]
    escalated = [router.before(f) or router.after(f, f) for f in feats]
    assert abs(sum(escalated) / len(fit) - target) <= 0.02


def test_logistic_regression_recovers_a_known_coefficient():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4000, 2))
    y = (rng.random(4000) < 1 / (1 + np.exp(-(2.0 * x[:, 0] - 0.5)))).astype(float)
    coef, bias = logistic(x, y, l2=0.01)
    assert coef[0] == pytest.approx(2.0, abs=0.25) and abs(coef[1]) < 0.15 and bias == pytest.approx(-0.5, abs=0.15)
