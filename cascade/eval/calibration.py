"""Choosing and judging escalation thresholds from scored samples (pure functions; the runner
that collects the samples is ``cascade calibrate``).

Two signals are fitted on the calibration half and judged on the held-out half: the local
answer's confidence over its first K tokens (escalate below a mean logprob) and a learned
difficulty score of the prompt (escalate above a threshold, before generating).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from cascade.eval.scoring import Task
from cascade.policy.hard import features as prompt_features
from cascade.policy.hard import fit


@dataclass
class Sample:
    task: Task
    edge_text: str = ""
    cloud_text: str = ""
    confidence: dict | None = None
    edge_score: float = 0.0
    cloud_score: float = 0.0


def quality(samples: list[Sample], escalate: list[bool]) -> float:
    return sum(s.cloud_score if e else s.edge_score for s, e in zip(samples, escalate, strict=True)) / len(samples)


def curve(samples: list[Sample], risk: list[float]) -> list[tuple[float, float]]:
    """(escalation rate, quality) escalating the riskiest first, from 0 to 100%."""
    order = sorted(range(len(samples)), key=lambda i: -risk[i])
    esc = [False] * len(samples)
    points = [(0.0, quality(samples, esc))]
    for k, i in enumerate(order, 1):
        esc[i] = True
        points.append((k / len(samples), quality(samples, esc)))
    return points


def apgr(points: list[tuple[float, float]], q_edge: float, q_cloud: float) -> float:
    """Average performance gap recovered (RouteLLM): the area under (q - q_edge) / (q_cloud -
    q_edge) over the escalation rate; random routing scores 0.5."""
    gap = q_cloud - q_edge
    if abs(gap) < 1e-12:
        return float("nan")
    area = 0.0
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        area += (x1 - x0) * ((y0 - q_edge) + (y1 - q_edge)) / 2
    return area / gap


def threshold_for(risk: list[float], target: float) -> float:
    """The risk above which a ``target`` share of these samples escalates."""
    ranked = sorted(risk, reverse=True)
    k = round(target * len(ranked))
    if k <= 0:
        return ranked[0] + 1e-9
    if k >= len(ranked):
        return ranked[-1] - 1e-9
    return (ranked[k - 1] + ranked[k]) / 2


def confidence_risk(s: Sample) -> float:
    c = s.confidence or {}
    return -float(c.get("mean_logprob", 0.0)) if c.get("tokens") else 0.0


@dataclass
class SignalResult:
    name: str
    threshold: float
    escalation: float  # held-out rate at that threshold
    quality_kept: float  # held-out quality / cloud-only quality
    apgr: float
    points: list[tuple[float, float]]


def evaluate(cal: list[Sample], held: list[Sample], target: float) -> tuple[list[SignalResult], dict]:
    q_edge_h = quality(held, [False] * len(held))
    q_cloud_h = quality(held, [True] * len(held))
    results = []
    # 1. confidence of the first K tokens
    thr = threshold_for([confidence_risk(s) for s in cal], target)
    risk_h = [confidence_risk(s) for s in held]
    results.append(judge("confidence", thr, held, risk_h, q_edge_h, q_cloud_h))
    # 2. learned difficulty of the prompt, before generating
    model = fit([prompt_features(s.task.prompt) for s in cal], [int(s.edge_score < s.cloud_score) for s in cal])
    thr = threshold_for([model.score(prompt_features(s.task.prompt)) for s in cal], target)
    risk_h = [model.score(prompt_features(s.task.prompt)) for s in held]
    results.append(judge("difficulty", thr, held, risk_h, q_edge_h, q_cloud_h))
    return results, {"q_edge": q_edge_h, "q_cloud": q_cloud_h, "difficulty_model": model.to_json()}


def judge(name, thr, held, risk, q_edge, q_cloud) -> SignalResult:
    esc = [r > thr for r in risk]
    pts = curve(held, risk)
    kept = quality(held, esc) / q_cloud if q_cloud else float("nan")
    return SignalResult(name, thr, sum(esc) / len(esc), kept, apgr(pts, q_edge, q_cloud), pts)


def split(samples: list[Sample], holdout: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    idx = list(range(len(samples)))
    random.Random(seed).shuffle(idx)
    k = math.floor(len(idx) * (1 - holdout))
    return [samples[i] for i in idx[:k]], [samples[i] for i in idx[k:]]
