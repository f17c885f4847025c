"""``cascade calibrate``: run the edge and the cloud model on a prompt set, score both, choose
the escalation threshold that hits a target rate, write it into the edge config, and plot
quality kept against escalation rate (with random routing for comparison).

Two signals are fitted on the calibration half and judged on the held-out half: the local
answer's confidence over its first K tokens (escalate below a mean logprob) and a learned
difficulty score of the prompt (escalate above a threshold, before generating). The one with
the larger held-out APGR is written into the config.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import tomllib
from dataclasses import dataclass
from pathlib import Path

import httpx

from cascade.policy.hard import features as prompt_features
from cascade.policy.hard import fit
from cascade.scoring import Task
from cascade.tasks import generate


@dataclass
class Sample:
    task: Task
    edge_text: str = ""
    cloud_text: str = ""
    confidence: dict | None = None
    edge_score: float = 0.0
    cloud_score: float = 0.0


def load_prompts(source: str, n: int, seed: int) -> list[Task]:
    if source == "tasks":
        return generate(n, seed)
    if source == "sharegpt":
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from bench.sharegpt import load_conversations

        rng = random.Random(seed)
        convs = [c for c in load_conversations() if 10 < len(c[0]) < 600]
        return [Task(c[0]) for c in rng.sample(convs, min(n, len(convs)))]
    tasks = []
    for line in Path(source).read_text().splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            d = json.loads(line)
            tasks.append(Task(d["prompt"], d.get("answer"), d.get("kind", "fact" if d.get("answer") else "open")))
        else:
            tasks.append(Task(line.strip()))
    return tasks[:n]


async def _ask(client: httpx.AsyncClient, url: str, headers: dict, prompt: str, max_tokens: int,
               extra: dict | None = None) -> dict:
    body = {"model": extra.pop("model") if extra and "model" in extra else "default",
            "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            **(extra or {})}
    for attempt in range(5):
        r = await client.post(f"{url.rstrip('/').removesuffix('/v1')}/v1/chat/completions", json=body,
                              headers=headers)
        if r.status_code == 429 and attempt < 4:
            await asyncio.sleep(float(r.headers.get("retry-after", "1")))
            continue
        r.raise_for_status()
        return r.json()
    raise RuntimeError("unreachable")


async def collect(tasks: list[Task], edge_url: str, edge_model: str, cloud_url: str, cloud_model: str,
                  cloud_key: str, max_tokens: int = 32, concurrency: int = 4, progress=None) -> list[Sample]:
    samples = [Sample(t) for t in tasks]
    gate = asyncio.Semaphore(concurrency)
    cloud_headers = {"authorization": f"Bearer {cloud_key}"} if cloud_key else {}
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(s: Sample) -> None:
            async with gate:
                edge = await _ask(client, edge_url, {}, s.task.prompt, max_tokens,
                                  {"model": edge_model, "cascade": {"mode": "local"}})
                cloud = await _ask(client, cloud_url, cloud_headers, s.task.prompt, max_tokens, {"model": cloud_model})
            s.edge_text = edge["choices"][0]["message"]["content"]
            s.confidence = (edge.get("cascade") or {}).get("confidence")
            s.cloud_text = cloud["choices"][0]["message"]["content"]
            s.edge_score = s.task.score(s.edge_text, s.cloud_text)
            s.cloud_score = s.task.score(s.cloud_text, s.cloud_text)
            if progress:
                progress()
        await asyncio.gather(*(one(s) for s in samples))
    return samples


# -- choosing and judging thresholds ---------------------------------------------------------

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
    results.append(_judge("confidence", thr, held, risk_h, q_edge_h, q_cloud_h))
    # 2. learned difficulty of the prompt, before generating
    model = fit([prompt_features(s.task.prompt) for s in cal], [int(s.edge_score < s.cloud_score) for s in cal])
    thr = threshold_for([model.score(prompt_features(s.task.prompt)) for s in cal], target)
    risk_h = [model.score(prompt_features(s.task.prompt)) for s in held]
    results.append(_judge("difficulty", thr, held, risk_h, q_edge_h, q_cloud_h))
    return results, {"q_edge": q_edge_h, "q_cloud": q_cloud_h, "difficulty_model": model.to_json()}


def _judge(name, thr, held, risk, q_edge, q_cloud) -> SignalResult:
    esc = [r > thr for r in risk]
    pts = curve(held, risk)
    kept = quality(held, esc) / q_cloud if q_cloud else float("nan")
    return SignalResult(name, thr, sum(esc) / len(esc), kept, apgr(pts, q_edge, q_cloud), pts)


# -- output ----------------------------------------------------------------------------------

def write_config(path: Path, updates: dict) -> None:
    import tomli_w

    data = tomllib.loads(path.read_text()) if path.is_file() else {}
    section = data.setdefault("cascade", {})
    section.update(updates)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(data))


def plot(results: list[SignalResult], q_edge: float, q_cloud: float, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    for r in results:
        xs, ys = zip(*r.points, strict=True)
        ax.plot([100 * x for x in xs], [100 * y / q_cloud for y in ys], label=f"{r.name} (APGR {r.apgr:.2f})")
    ax.plot([0, 100], [100 * q_edge / q_cloud, 100], "--", color="grey", label="random routing (APGR 0.50)")
    ax.axvline(100 * target, color="black", lw=0.8, ls=":")
    ax.axhline(90, color="red", lw=0.6, ls=":")
    ax.set_xlabel("escalated to the cloud (%)")
    ax.set_ylabel("quality kept (% of cloud-only)")
    ax.set_title("Cascade calibration, held-out prompts")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def split(samples: list[Sample], holdout: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    idx = list(range(len(samples)))
    random.Random(seed).shuffle(idx)
    k = math.floor(len(idx) * (1 - holdout))
    return [samples[i] for i in idx[:k]], [samples[i] for i in idx[k:]]
