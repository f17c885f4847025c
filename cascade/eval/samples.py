"""Scored samples to and from JSON (``samples.json``): what ``cascade calibrate`` and
bench/router_quality.py keep of a run, so a router can be fitted again without the tiers."""

from __future__ import annotations

from cascade.eval.calibration import Sample
from cascade.eval.scoring import Task


def to_json(samples: list[Sample]) -> list[dict]:
    return [{"prompt": s.task.prompt, "answer": s.task.answer, "kind": s.task.kind, "tests": s.task.tests,
             "max_tokens": s.task.max_tokens, "edge": s.edge_text, "cloud": s.cloud_text,
             "confidence": s.confidence, "edge_score": s.edge_score, "cloud_score": s.cloud_score}
            for s in samples]


def from_json(rows: list[dict]) -> list[Sample]:
    out = []
    for r in rows:
        task = Task(r["prompt"], r.get("answer"), r.get("kind") or "open", r.get("tests"), int(r.get("max_tokens", 32)))
        out.append(Sample(task, r.get("edge", ""), r.get("cloud", ""), r.get("confidence"),
                          float(r.get("edge_score", 0.0)), float(r.get("cloud_score", 0.0))))
    return out
