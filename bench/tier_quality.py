"""What escalation buys: each tier's share of right answers on the graded set of our own
(cascade.eval.tasks: arithmetic of graded difficulty, unit conversions, facts from tables,
extraction, formatting, short Python questions with one checkable answer, and code problems graded
by running their hidden asserts), greedy, the same prompts to both tiers in the same run.

    .venv/bin/python bench/tier_quality.py [--n 120] [--seed 39] [--weight-dtype int8]
    .venv/bin/python bench/tier_quality.py --edge URL --cloud URL --api-key KEY   # tiers already up

Without URLs it starts both tiers itself: the edge agent on the device's model (llama.cpp) and
the cloud tier (`cascade cloud serve`, our engine, a prefill and a decode worker) on the cloud's model.
The set is generated with a seed of its own, not the one `cascade calibrate` uses by default, so
thresholds calibrated with the defaults are never judged on the prompts they were fitted on.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from tiers import bench_env, cloud_key, start_cloud, start_edge  # noqa: I001 (a sibling: sys.path[0] is bench/)

from cascade.eval.scoring import Task
from cascade.eval.tasks import generate
from cascade.processes import stop, wait_healthy
from cascade_cli.calibrate.tiers import collect


def graded_set(n: int, seed: int) -> list[tuple[str, Task]]:
    """(group, task): the shared graded set, grouped by kind."""
    return [(t.kind, t) for t in generate(n, seed)]


def start_tiers(args, work: Path) -> tuple[list, str, str, str]:
    env = bench_env(work)
    key = cloud_key(env, work)
    cloud, cloud_url = start_cloud(env, args.cloud_model, args.weight_dtype)
    edge, edge_url = start_edge({**env, "CASCADE_EDGE_UPSTREAM_URL": ""}, args.edge_model)
    wait_healthy(edge_url, edge, 900, "edge agent")
    wait_healthy(cloud_url, cloud, 1800, "cloud tier")
    return [edge, cloud], edge_url, cloud_url, key


def report(groups: list[str], samples) -> None:
    by: dict[str, list] = defaultdict(list)
    for g, s in zip(groups, samples, strict=True):
        by[g].append(s)
        by["all"].append(s)
    print(f"\n{'group':<12} {'items':>5} {'edge right':>11} {'cloud right':>12} {'cloud only':>11} {'edge only':>10}")
    for g in sorted(by, key=lambda k: (k == "all", k)):
        ss = by[g]
        e = sum(s.edge_score for s in ss)  # graded once, when collected (code runs in a child process)
        c = sum(s.cloud_score for s in ss)
        c_only = sum(1 for s in ss if s.cloud_score and not s.edge_score)
        e_only = sum(1 for s in ss if s.edge_score and not s.cloud_score)
        print(f"{g:<12} {len(ss):>5} {e / len(ss):>10.1%} {c / len(ss):>11.1%} {c_only:>11} {e_only:>10}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=120, help="items in the graded set")
    p.add_argument("--seed", type=int, default=39)
    p.add_argument("--edge", help="a running edge agent's URL (default: start one)")
    p.add_argument("--cloud", help="a running cloud tier's URL (default: start one)")
    p.add_argument("--api-key", default="", help="the cloud key, with --cloud")
    p.add_argument("--edge-model", default="qwen2.5-coder-0.5b")
    p.add_argument("--cloud-model", default="qwen2.5-coder-1.5b")
    p.add_argument("--weight-dtype", default="auto", help="the cloud engine's weights, when started here")
    p.add_argument("--max-tokens", type=int, default=0, help="tokens per answer (0: each kind's own; code 128)")
    args = p.parse_args()
    if bool(args.edge) != bool(args.cloud):
        p.error("give both --edge and --cloud, or neither")
    items = graded_set(args.n, args.seed)
    procs = []
    work = Path(tempfile.mkdtemp(prefix="tier-quality-"))
    try:
        if args.edge:
            edge_url, cloud_url, key = args.edge, args.cloud, args.api_key
        else:
            procs, edge_url, cloud_url, key = start_tiers(args, work)
        samples = asyncio.run(collect([t for _, t in items], edge_url, args.edge_model, cloud_url, args.cloud_model,
                                      key, max_tokens=args.max_tokens, concurrency=2))
    finally:
        for proc in procs:
            stop(proc)
    print(f"graded set: {len(items)} items (seed {args.seed}), greedy, {args.max_tokens or 'per-kind'} tokens; "
          f"edge {args.edge_model} (llama.cpp), cloud {args.cloud_model} (our engine, weights {args.weight_dtype})")
    report([g for g, _ in items], samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
