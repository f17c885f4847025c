"""The cascade end to end: a mixed graded workload sent through `cascade edge run` (the real agent,
its policy deciding), against always-edge and always-cloud, counting what the cloud spent in tokens
and what quality was kept. The issue 40 goal: >= 95% of always-cloud quality for <= 40% of its
cloud tokens.

    .venv/bin/python bench/cascade_end_to_end.py --config edge.toml [--config old.toml ...] [--n 200]

Each ``--config`` is an edge.toml (from `cascade calibrate`: the router, or an older difficulty
score and thresholds) run as one policy in auto mode; always-edge and always-cloud are the same
agent with `cascade.mode` local and cloud. The cloud (`cascade cloud serve`, our engine) and one
agent per config are started here. The prompts come from `cascade calibrate`'s task generator with
a seed of their own (default 40; calibration's default is 0), so no policy is judged on the items
it was fitted on. Cloud tokens: the prompt and completion tokens of every answer the cloud gave,
as its usage says.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import tiers  # noqa: I001 (a sibling: sys.path[0] is bench/)
from tiers import bench_env, cloud_key  # noqa: I001 (a sibling: sys.path[0] is bench/)

from cascade.processes import stop, wait_healthy
from cascade_cli.calibrate.prompts import load_prompts


@dataclass
class Run:
    name: str
    right: float = 0.0
    cloud_tokens: int = 0
    escalated: int = 0
    reasons: dict = field(default_factory=dict)
    seconds: float = 0.0


async def ask(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, mode: str, model: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "cascade": {"mode": mode}}
    for _ in range(5):
        r = await client.post(f"{url}/v1/chat/completions", json=body)
        if r.status_code != 429:
            r.raise_for_status()
            return r.json()
        await asyncio.sleep(1.0)
    r.raise_for_status()
    return r.json()


async def run_policy(name: str, url: str, tasks, max_tokens: int, mode: str, concurrency: int, model: str) -> Run:
    out, gate = Run(name), asyncio.Semaphore(concurrency)
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(task):
            async with gate:
                answer = await ask(client, url, task.prompt, getattr(task, "max_tokens", None) or max_tokens, mode,
                                   model)
            info = answer.get("cascade") or {}
            out.right += task.score(answer["choices"][0]["message"]["content"] or "")
            out.reasons[info.get("reason", "?")] = out.reasons.get(info.get("reason", "?"), 0) + 1
            if info.get("tier") == "cloud":
                out.escalated += 1
                usage = answer.get("usage") or {}
                out.cloud_tokens += int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
        await asyncio.gather(*(one(t) for t in tasks))
    out.seconds = time.perf_counter() - started
    return out


def start_cloud_tier(args, work: Path, env: dict) -> tuple[subprocess.Popen, str, str]:
    key = cloud_key(env, work)
    cloud, url = tiers.start_cloud(env, args.cloud_model, args.weight_dtype, max_model_len=2048)
    wait_healthy(url, cloud, 1800, "cloud tier")
    return cloud, url, key


def start_agent(args, config: str | None, cloud_url: str, key: str, env: dict) -> tuple[subprocess.Popen, str]:
    edge, url = tiers.start_edge({**env, "CASCADE_EDGE_UPSTREAM_URL": cloud_url, "CASCADE_EDGE_UPSTREAM_API_KEY": key,
                                  "CASCADE_EDGE_MODEL_NAME": None}, args.edge_model,
                                 *(["--config", config] if config else []), n_ctx=2048)
    wait_healthy(url, edge, 900, "edge agent")
    return edge, url


def report(runs: list[Run], n: int) -> None:
    cloud = runs[1]
    print(f"\n{'policy':<28} {'right':>7} {'% of cloud':>11} {'escalated':>10} {'cloud tokens':>13} "
          f"{'% of cloud':>11} {'s':>7}  reasons")
    for r in runs:
        kept = r.right / cloud.right if cloud.right else float("nan")
        spent = r.cloud_tokens / cloud.cloud_tokens if cloud.cloud_tokens else float("nan")
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r.reasons.items(), key=lambda kv: -kv[1]))
        print(f"{r.name:<28} {r.right / n:>7.1%} {kept:>11.1%} {r.escalated / n:>10.1%} {r.cloud_tokens:>13} "
              f"{spent:>11.1%} {r.seconds:>7.0f}  {reasons}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", default=[], help="an edge.toml to run as a policy (repeatable)")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--seed", type=int, default=40)
    p.add_argument("--edge-model", default="qwen2.5-coder-0.5b")
    p.add_argument("--cloud-model", default="qwen2.5-coder-1.5b")
    p.add_argument("--weight-dtype", default="int8")
    p.add_argument("--max-tokens", type=int, default=48, help="for tasks that do not say")
    p.add_argument("--concurrency", type=int, default=2)
    args = p.parse_args()
    tasks = load_prompts("tasks", args.n, args.seed)
    work = Path(tempfile.mkdtemp(prefix="cascade-e2e-"))
    env = bench_env(work)
    procs: list = []
    runs: list[Run] = []
    try:
        cloud, cloud_url, key = start_cloud_tier(args, work, env)
        procs.append(cloud)
        edge, url = start_agent(args, None, cloud_url, key, env)
        procs.append(edge)
        for name, mode in (("always-edge", "local"), ("always-cloud", "cloud")):
            runs.append(asyncio.run(run_policy(name, url, tasks, args.max_tokens, mode, args.concurrency,
                                               args.edge_model)))
            print(f"  {name}: done", file=sys.stderr)
        stop(procs.pop())
        for config in args.config:
            edge, url = start_agent(args, config, cloud_url, key, env)
            runs.append(asyncio.run(run_policy(f"auto: {Path(config).name}", url, tasks, args.max_tokens, "auto",
                                               args.concurrency, args.edge_model)))
            stop(edge)
            print(f"  {config}: done", file=sys.stderr)
    finally:
        for proc in procs:
            stop(proc)
    print(f"{len(tasks)} tasks (seed {args.seed}), greedy; edge {args.edge_model} (llama.cpp), cloud "
          f"{args.cloud_model} (our engine, weights {args.weight_dtype})")
    report(runs, len(tasks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
