"""Judging the router on held-out samples, beside each signal alone, the old difficulty score and
confidence threshold, and random routing: APGR, quality kept at fixed escalation rates, and the
escalation rate the written thresholds give (``cascade calibrate`` and bench/router_quality.py)."""

from __future__ import annotations

import time

import numpy as np

from cascade.eval import calibration as cal
from cascade.eval.router_fit import fit_router, labels, sample_features
from cascade.policy.router import UNCERTAINTY_FEATURES, Router, prompt_features, uncertainty_features

RATES = (0.1, 0.2, 0.3, 0.4, 0.5)


def kept_at(result: cal.SignalResult, rate: float, q_cloud: float) -> float:
    """Quality kept (share of cloud-only) escalating the riskiest ``rate`` of the prompts."""
    points = result.points
    return points[round(rate * (len(points) - 1))][1] / q_cloud if q_cloud else float("nan")


def rate_for(result: cal.SignalResult, share: float, q_cloud: float) -> float:
    """The least escalation rate at which ``share`` of the cloud-only quality is kept."""
    return next((x for x, q in result.points if q_cloud and q / q_cloud >= share - 1e-12), 1.0)


def _oriented(fit_values: list[float], y: np.ndarray) -> float:
    """+1 when larger values go with a gap on the fitting half, else -1."""
    v = np.asarray(fit_values)
    if v.std() < 1e-12 or y.std() < 1e-12:
        return 1.0
    return 1.0 if np.corrcoef(v, y)[0, 1] >= 0 else -1.0


def two_stage_risk(router: Router, feats: dict[str, float]) -> float:
    """An ordering that follows the router: what stage 1 escalates first, then stage 2's score."""
    s1 = router.stage1.score(feats)
    return 2.0 + s1 if s1 > router.stage1_threshold else router.stage2.score(feats)


def evaluate_router(fit: list[cal.Sample], held: list[cal.Sample], target: float, router: Router | None = None,
                    edge_model: str = "edge", window: int = 16) -> tuple[list[cal.SignalResult], dict]:
    """(one result per signal, info): the router fitted on ``fit`` (unless given) judged on ``held``."""
    window = router.window if router else window
    if router is None:
        router, _ = fit_router(fit, target, window, edge_model)
    q_e = cal.quality(held, [False] * len(held))
    q_c = cal.quality(held, [True] * len(held))
    f_fit = [sample_features(s, window) for s in fit]
    f_held = [sample_features(s, window) for s in held]
    y_fit = labels(fit)
    results: list[cal.SignalResult] = []

    def judge(name: str, risk_fit: list[float], risk_held: list[float]) -> None:
        thr = cal.threshold_for(risk_fit, target)
        results.append(cal.judge(name, thr, held, risk_held, q_e, q_c))

    for name in UNCERTAINTY_FEATURES:
        sign = _oriented([f[name] for f in f_fit], y_fit)
        judge(name, [sign * f[name] for f in f_fit], [sign * f[name] for f in f_held])
    old, info = cal.evaluate(fit, held, target)  # the old confidence and difficulty signals
    for r in old:
        results.append(cal.SignalResult(f"old {r.name}", r.threshold, r.escalation, r.quality_kept, r.apgr,
                                        r.points))
    judge("prompt-only", [router.stage1.score(f) for f in f_fit], [router.stage1.score(f) for f in f_held])
    judge("full", [router.stage2.score(f) for f in f_fit], [router.stage2.score(f) for f in f_held])
    escalated = [router.before(f) or router.after(f, f) for f in f_held]
    before = sum(router.before(f) for f in f_held) / len(held)
    pts = cal.curve(held, [two_stage_risk(router, f) for f in f_held])
    results.append(cal.SignalResult("router", router.stage2_threshold, sum(escalated) / len(held),
                                    cal.quality(held, escalated) / q_c if q_c else float("nan"),
                                    cal.apgr(pts, q_e, q_c), pts))
    return results, {**info, "router": router, "router_before": before, "q_edge": q_e, "q_cloud": q_c}


def signal_costs(samples: list[cal.Sample], router: Router, repeat: int = 3) -> dict[str, float]:
    """Microseconds per request, here: prompt features, uncertainty features of K tokens, each stage."""
    prompts = [s.task.prompt for s in samples]
    confs = [s.confidence or {} for s in samples]
    k = router.window

    def per_request(fn) -> float:
        best = float("inf")
        for _ in range(repeat):
            started = time.perf_counter()
            for i in range(len(samples)):
                fn(i)
            best = min(best, (time.perf_counter() - started) / len(samples) * 1e6)
        return best
    feats = [sample_features(s, k) for s in samples]
    return {"prompt features": per_request(lambda i: prompt_features(prompts[i])),
            "uncertainty features": per_request(lambda i: uncertainty_features(
                (confs[i].get("logprobs") or [])[:k], (confs[i].get("entropies") or [])[:k], k)),
            "stage 1 score": per_request(lambda i: router.stage1.score(feats[i])),
            "stage 2 score": per_request(lambda i: router.stage2.score(feats[i]))}


def print_table(results: list[cal.SignalResult], info: dict, target: float) -> None:
    q_e, q_c = info["q_edge"], info["q_cloud"]
    print(f"held-out quality: edge only {q_e:.3f}, cloud only {q_c:.3f}"
          + (f" (edge keeps {q_e / q_c:.1%} alone)" if q_c else ""))
    rates = "".join(f"{f'kept@{round(r * 100)}%':>10s}" for r in RATES)
    print(f"{'signal':14s} {'APGR':>6s}{rates} {'esc@thr':>8s} {'kept@thr':>9s} {'esc for 95%':>12s}")
    for r in results:
        kept = "".join(f"{kept_at(r, x, q_c):10.1%}" for x in RATES)
        print(f"{r.name:14s} {r.apgr:6.3f}{kept} {r.escalation:8.1%} {r.quality_kept:9.1%} "
              f"{rate_for(r, 0.95, q_c):12.1%}")
    kept = "".join(f"{(q_e + x * (q_c - q_e)) / q_c if q_c else float('nan'):10.1%}" for x in RATES)
    print(f"{'random':14s} {0.5:6.3f}{kept} {target:8.1%}")
    print(f"router at its thresholds: {info['router_before']:.1%} escalated before generating (\"hard\"), "
          f"the rest after the hold-back (\"low_confidence\")")
