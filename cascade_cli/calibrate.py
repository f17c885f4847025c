"""``cascade calibrate``: run the edge and the cloud model on a prompt set, score both, choose
the escalation threshold that hits a target rate (``cascade.eval.calibration``), write it into
the edge config, and plot quality kept against escalation rate (with random routing for
comparison). The signal with the larger held-out APGR is written into the config.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

import httpx

from cascade.eval.calibration import Sample, SignalResult
from cascade.eval.scoring import Task
from cascade.eval.tasks import generate
from cascade.policy.backpressure import parse_retry_after
from cascade.wire import WireError, loads

MAX_ANSWER_BYTES = 8 << 20  # an answer of either tier, decoded strictly


class Unreachable(RuntimeError):
    """A tier calibration needs did not answer: the message says which, at what URL, and how to start it."""


def _v1(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1") + "/v1"


def served_model(url: str, headers: dict, what: str, start: str) -> str:
    """The first model ``GET /v1/models`` at ``url`` lists; Unreachable naming ``what`` and how to
    ``start`` it when nothing (or not an OpenAI server) answers there."""
    models = f"{_v1(url)}/models"
    try:
        r = httpx.get(models, timeout=10, headers=headers)
    except httpx.HTTPError as e:
        raise Unreachable(f"cannot reach {what} at {models} ({type(e).__name__}: {e}); {start}") from e
    if r.status_code in (401, 403):
        raise Unreachable(f"{what} at {models} refused the key (HTTP {r.status_code}): pass --api-key or set "
                          "[upstream] api_key")
    if not r.is_success:
        raise Unreachable(f"{what} at {models} answered HTTP {r.status_code}: {r.text[:200]}")
    try:
        return loads(r.content, limit=MAX_ANSWER_BYTES)["data"][0]["id"]
    except (WireError, KeyError, IndexError, TypeError) as e:
        raise Unreachable(f"{what} at {models} did not answer an OpenAI model list ({e!r}); is that its URL?") from e


def load_prompts(source: str, n: int, seed: int) -> list[Task]:
    if source == "tasks":
        return generate(n, seed)
    if source == "sharegpt":
        from cascade.eval.sharegpt import load_conversations

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
        r = await client.post(f"{_v1(url)}/chat/completions", json=body, headers=headers)
        if r.status_code == 429 and attempt < 4:
            await asyncio.sleep(parse_retry_after(r.headers.get("retry-after"), limit_s=60.0) or 1.0)
            continue
        r.raise_for_status()
        return loads(r.content, limit=MAX_ANSWER_BYTES)
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


def run(args) -> int:
    """``cascade calibrate``: the exit status."""
    import math

    from cascade.config import ConfigError, cascade_home, write_section
    from cascade.eval import calibration as cal
    from edge_agent.config import EdgeConfig

    home = cascade_home()
    config_path = Path(args.config) if args.config else home / "edge.toml"
    try:
        edge_cfg = EdgeConfig.load(config_path if config_path.is_file() else None)
    except ConfigError as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    cloud_url = args.cloud or edge_cfg.upstream.url
    if not cloud_url:
        print("cascade: no cloud to compare with: pass --cloud URL or set [upstream] url", file=sys.stderr)
        return 2
    key = args.api_key if args.api_key is not None else edge_cfg.upstream.api_key
    try:
        # both tiers are asked first, so that one not running is named with how to start it
        edge_model = served_model(args.edge, {}, "the edge agent",
                                  "start it with `cascade edge run` (or pass --edge URL)")
        edge_model = args.edge_model or edge_model
        cloud_model = served_model(cloud_url, {"authorization": f"Bearer {key}"} if key else {}, "the cloud tier",
                                   "start it with `cascade cloud serve` (or pass --cloud URL, or set [upstream] url)")
        cloud_model = args.cloud_model or edge_cfg.upstream.model or cloud_model
    except Unreachable as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 1
    try:
        tasks = load_prompts(args.prompts, args.num_prompts, args.seed)
        done = [0]

        def tick():
            done[0] += 1
            if done[0] % 50 == 0 or done[0] == len(tasks):
                print(f"  {done[0]}/{len(tasks)} prompts answered by both tiers", file=sys.stderr)
        samples = asyncio.run(collect(tasks, args.edge, edge_model, cloud_url, cloud_model, key,
                                          args.max_tokens, args.concurrency, tick))
    except httpx.HTTPError as e:
        try:
            where = e.request.url
        except RuntimeError:  # an error httpx raised before it had a request
            where = "?"
        print(f"cascade: calibration failed at {where}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except (OSError, KeyError, IndexError, TypeError, ValueError) as e:
        print(f"cascade: calibration failed: {e!r}", file=sys.stderr)
        return 1
    calib, held = cal.split(samples, args.holdout, args.seed)
    results, info = cal.evaluate(calib, held, args.target_escalation)
    best = max(results, key=lambda r: -1 if math.isnan(r.apgr) else r.apgr)
    out_dir = home / "calibration"
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = out_dir / "difficulty.json"
    model_path.write_text(json.dumps(info["difficulty_model"], indent=2))
    updates = {"difficulty_model": str(model_path)}
    if best.name == "confidence":
        updates.update(min_mean_logprob=-best.threshold, difficulty_threshold=1.01)
    else:
        updates.update(difficulty_threshold=best.threshold, min_mean_logprob=-math.inf)
    write_section(config_path, "cascade", updates)
    plot_path = Path(args.plot) if args.plot else out_dir / "calibration.png"
    plot(results, info["q_edge"], info["q_cloud"], args.target_escalation, plot_path)
    (out_dir / "samples.json").write_text(json.dumps(
        [{"prompt": s.task.prompt, "answer": s.task.answer, "edge": s.edge_text, "cloud": s.cloud_text,
          "confidence": s.confidence, "edge_score": s.edge_score, "cloud_score": s.cloud_score} for s in samples],
        indent=1))
    q_e, q_c = info["q_edge"], info["q_cloud"]
    print(f"{len(samples)} prompts ({len(calib)} to fit, {len(held)} held out); edge {edge_model} @ {args.edge}, "
          f"cloud {cloud_model} @ {cloud_url}")
    print(f"held-out quality: edge only {q_e:.3f}, cloud only {q_c:.3f} (edge keeps {q_e / q_c:.1%} alone)"
          if q_c else f"held-out quality: edge only {q_e:.3f}, cloud only {q_c:.3f}")
    print(f"{'signal':12s} {'threshold':>10s} {'escalated':>10s} {'quality kept':>13s} {'APGR':>6s}")
    for r in results:
        print(f"{r.name:12s} {r.threshold:10.4f} {r.escalation:10.1%} {r.quality_kept:13.1%} {r.apgr:6.3f}"
              f"{'  <- written' if r is best else ''}")
    random_kept = (q_e + args.target_escalation * (q_c - q_e)) / q_c if q_c else float("nan")
    print(f"{'random':12s} {'':>10s} {args.target_escalation:10.1%} {random_kept:13.1%} {0.5:6.3f}")
    print(f"wrote [cascade] {', '.join(f'{k}={v}' for k, v in updates.items())} to {config_path}")
    print(f"plot: {plot_path}")
    print(f"apply it: cascade edge run --config {config_path}  (an agent running now keeps its old thresholds "
          "until restarted with that config)")
    return 0
