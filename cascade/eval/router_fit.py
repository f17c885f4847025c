"""Fitting the router (cascade/policy/router.py) on scored samples, with numpy.

Labels are the gap: 1 where the cloud's answer scored better than the device's. Each stage is an
L2-regularized logistic regression on standardized features, solved by Newton's method (a few
hundred rows, a few dozen features: exact in a handful of iterations); the L2 strength is chosen
by cross-validated log-loss. The two thresholds are chosen on the fitting samples so that the
overall escalation rate is the target: the share stage 1 escalates before generating is the one
that keeps the most quality by out-of-fold scores (ties: the smaller share: stage 2 reads the
prompt features too, so stage 1 goes first only where that gains), and stage 2 escalates the rest
of the target among what stage 1 kept.
"""

from __future__ import annotations

import math

import numpy as np

from cascade.eval.calibration import Sample
from cascade.policy.router import (
    FEATURE_BOUND,
    FEATURES,
    MIN_SCALE,
    PROMPT_FEATURES,
    Router,
    Stage,
    combined,
    prompt_features,
    uncertainty_features,
)

L2_GRID = (0.1, 1.0, 10.0, 100.0)
FOLDS = 5


def sample_features(s: Sample, window: int) -> dict[str, float]:
    """A sample's stage-2 features: its prompt's and, from its ``cascade.confidence``, its
    uncertainty features (the K values when the agent returned them, else its mean and minimum as
    the quantiles), with their interactions."""
    c = s.confidence if isinstance(s.confidence, dict) else {}
    lps, ents = _numbers(c.get("logprobs")), _numbers(c.get("entropies"))
    if not lps and c.get("tokens"):  # an agent that returned only the summary
        lps, ents = _numbers([c.get("min_logprob"), c.get("mean_logprob")]), _numbers([c.get("mean_entropy", 0.0)])
    return combined(prompt_features(s.task.prompt), uncertainty_features(lps[:window], ents[:window], window))


def _numbers(values) -> list[float]:
    """An agent's numbers (its answer's ``cascade.confidence``), each clamped into what a router file
    holds; what is not a number is left out."""
    if not isinstance(values, list):
        return []
    return [min(max(float(v), -FEATURE_BOUND), FEATURE_BOUND) for v in values
            if isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v)]


def labels(samples: list[Sample]) -> np.ndarray:
    return np.array([float(s.cloud_score - s.edge_score > 0) for s in samples])


def matrix(rows: list[dict[str, float]], names: tuple[str, ...]) -> np.ndarray:
    x = np.array([[r.get(k, 0.0) for k in names] for r in rows], dtype=float).reshape(len(rows), len(names))
    # what a router file may hold (cascade.policy.router): an edge's -inf logprob is a very low one
    x = np.nan_to_num(x, nan=0.0, posinf=FEATURE_BOUND, neginf=-FEATURE_BOUND)
    return np.clip(x, -FEATURE_BOUND, FEATURE_BOUND)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -60, 60)))


def logistic(x: np.ndarray, y: np.ndarray, w: np.ndarray | None = None, l2: float = 1.0,
             iters: int = 50) -> tuple[np.ndarray, float]:
    """(weights, bias) of L2-regularized logistic regression on ``x`` (already standardized),
    by Newton's method; ``w``: sample weights (normalized to mean 1)."""
    n, d = x.shape
    w = np.ones(n) if w is None else w * (n / max(w.sum(), 1e-12))
    xb = np.hstack([np.ones((n, 1)), x])
    beta = np.zeros(d + 1)
    reg = l2 * np.eye(d + 1)
    reg[0, 0] = 0.0  # the bias is not shrunk
    for _ in range(iters):
        p = _sigmoid(xb @ beta)
        grad = xb.T @ (w * (p - y)) + reg @ beta
        hess = xb.T @ (xb * (w * p * (1 - p))[:, None]) + reg + 1e-9 * np.eye(d + 1)
        step = np.linalg.solve(hess, grad)
        beta -= step
        if np.max(np.abs(step)) < 1e-8:
            break
    return beta[1:], float(beta[0])


def _standardize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean, scale = x.mean(axis=0), x.std(axis=0)
    return mean, np.where(scale >= MIN_SCALE, scale, 1.0)


def _folds(n: int, seed: int) -> list[np.ndarray]:
    idx = np.random.default_rng(seed).permutation(n)
    return [idx[k::FOLDS] for k in range(FOLDS)]


def _fit_scores(x: np.ndarray, y: np.ndarray, w: np.ndarray, l2: float, train: np.ndarray,
                test: np.ndarray) -> np.ndarray:
    mean, scale = _standardize(x[train])
    coef, bias = logistic((x[train] - mean) / scale, y[train], w[train], l2)
    return _sigmoid(((x[test] - mean) / scale) @ coef + bias)


def out_of_fold(x: np.ndarray, y: np.ndarray, w: np.ndarray, l2: float, seed: int = 0) -> np.ndarray:
    """Each row's score from a model fitted without its fold."""
    scores = np.zeros(len(y))
    folds = _folds(len(y), seed)
    for k, test in enumerate(folds):
        train = np.concatenate([f for j, f in enumerate(folds) if j != k])
        scores[test] = _fit_scores(x, y, w, l2, train, test)
    return scores


def choose_l2(x: np.ndarray, y: np.ndarray, w: np.ndarray, seed: int = 0) -> float:
    def loss(l2: float) -> float:
        p = np.clip(out_of_fold(x, y, w, l2, seed), 1e-6, 1 - 1e-6)
        return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
    return min(L2_GRID, key=loss)


def fit_stage(rows: list[dict[str, float]], y: np.ndarray, names: tuple[str, ...], w: np.ndarray | None = None,
              l2: float | None = None, seed: int = 0) -> tuple[Stage, np.ndarray]:
    """(the stage, its out-of-fold scores on these rows)."""
    x = matrix(rows, names)
    w = np.ones(len(y)) if w is None else w
    l2 = choose_l2(x, y, w, seed) if l2 is None else l2
    mean, scale = _standardize(x)
    coef, bias = logistic((x - mean) / scale, y, w, l2)
    stage = Stage({k: float(c) for k, c in zip(names, coef, strict=True)},
                  {k: float(m) for k, m in zip(names, mean, strict=True)},
                  {k: float(s) for k, s in zip(names, scale, strict=True)}, bias)
    return stage, out_of_fold(x, y, w, l2, seed)


def _above(scores: np.ndarray, k: int) -> float:
    """The threshold above which the ``k`` highest of ``scores`` lie (> 1: none)."""
    ranked = np.sort(scores)[::-1]
    if k <= 0 or not len(ranked):
        return 1.01  # a score is at most 1
    if k >= len(ranked):
        return max(0.0, float(ranked[-1]) - 1e-9)
    return float((ranked[k - 1] + ranked[k]) / 2)


def _two_stage(s1: np.ndarray, s2: np.ndarray, n1: int, total: int) -> np.ndarray:
    """Which rows escalate when stage 1 takes its ``n1`` highest and stage 2 the next ``total - n1``
    highest of its own scores among the rest."""
    esc = np.zeros(len(s1), dtype=bool)
    esc[np.argsort(-s1, kind="stable")[:n1]] = True
    rest = np.flatnonzero(~esc)
    esc[rest[np.argsort(-s2[rest], kind="stable")[:max(0, total - n1)]]] = True
    return esc


def choose_thresholds(s1: np.ndarray, s2: np.ndarray, s1_oof: np.ndarray, s2_oof: np.ndarray,
                      gain: np.ndarray, target: float) -> tuple[float, float]:
    """(stage1_threshold, stage2_threshold) so that ``target`` of these rows escalate; ``gain``: the
    quality escalating each row buys (cloud - edge score)."""
    n = len(s1)
    total = round(target * n)
    best_n1, best_q = 0, -np.inf
    for n1 in range(0, total + 1, max(1, n // 40)):
        q = float(gain[_two_stage(s1_oof, s2_oof, n1, total)].sum())
        if q > best_q + 1e-9:  # stage 1 takes more only when that keeps more quality out of fold
            best_n1, best_q = n1, q
    t1 = _above(s1, best_n1)
    kept = s1 <= t1
    t2 = _above(s2[kept], total - int((~kept).sum()))
    return t1, t2


def fit_router(samples: list[Sample], target: float, window: int, edge_model: str, edge_sha256: str = "",
               gap_weights: bool = False, seed: int = 0) -> tuple[Router, dict]:
    """The router for these samples, and the out-of-fold scores of its stages (for reporting)."""
    rows = [sample_features(s, window) for s in samples]
    y = labels(samples)
    gain = np.array([s.cloud_score - s.edge_score for s in samples])
    w = 1.0 + np.abs(gain) if gap_weights else np.ones(len(samples))
    stage1, s1_oof = fit_stage(rows, y, PROMPT_FEATURES, w, seed=seed)
    stage2, s2_oof = fit_stage(rows, y, FEATURES, w, seed=seed)
    s1 = np.array([stage1.score(r) for r in rows])
    s2 = np.array([stage2.score(r) for r in rows])
    t1, t2 = choose_thresholds(s1, s2, s1_oof, s2_oof, gain, target)
    router = Router(edge_model, edge_sha256, window, stage1, stage2, t1, t2, target)
    return router, {"stage1_oof": s1_oof, "stage2_oof": s2_oof}
