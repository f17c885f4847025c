"""The cascade's router on the quality gap: both tiers answer a graded set (cascade.eval.tasks:
short answers, arithmetic of graded difficulty, extraction, conversions, formatting, and code
problems graded by running their tests); the router (cascade.policy.router) is fitted on one half
and judged on the other, against each signal alone, the old difficulty score and random routing.

    .venv/bin/python bench/router_quality.py [--n 400] [--seed 7] [--weight-dtype int8]
    .venv/bin/python bench/router_quality.py --edge URL --cloud URL --api-key KEY   # tiers already up
    .venv/bin/python bench/router_quality.py --samples samples.json                 # answers kept before

Without URLs it starts both tiers itself: the edge agent on the device's model (llama.cpp) and the
cloud tier (`cascade cloud serve`, our engine, one co-located worker) on the cloud's model. The
answers are kept (``--out``) so the fit can be redone without the tiers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from tiers import bench_env, cloud_key, start_cloud, start_edge  # noqa: I001 (a sibling: sys.path[0] is bench/)

from cascade.eval import calibration as cal
from cascade.eval import samples as sample_io
from cascade.eval.router_eval import evaluate_router, print_table, signal_costs
from cascade.eval.router_fit import fit_router
from cascade.eval.tasks import generate
from cascade.processes import stop, wait_healthy
from cascade_cli.calibrate.tiers import collect


def start_tiers(args, work: Path) -> tuple[list, str, str, str]:
    env = bench_env(work)
    key = cloud_key(env, work)
    cloud, cloud_url = start_cloud(env, args.cloud_model, args.weight_dtype, "--both", "1", "--prefill", "0",
                                   "--decode", "0")
    # the agent returns the logprobs of its first hold_tokens tokens: record more than the router
    # reads, so other windows can be judged from the same answers
    edge, edge_url = start_edge({**env, "CASCADE_EDGE_UPSTREAM_URL": "",
                                 "CASCADE_EDGE_CASCADE_HOLD_TOKENS": str(args.record)}, args.edge_model)
    wait_healthy(edge_url, edge, 900, "edge agent")
    wait_healthy(cloud_url, cloud, 1800, "cloud tier")
    return [edge, cloud], edge_url, cloud_url, key


def collect_samples(args) -> list:
    tasks = generate(args.n, args.seed)
    procs = []
    work = Path(tempfile.mkdtemp(prefix="router-quality-"))
    done = [0]

    def tick():
        done[0] += 1
        if done[0] % 25 == 0:
            print(f"  {done[0]}/{len(tasks)} answered by both tiers", file=sys.stderr, flush=True)
    try:
        if args.edge:
            edge_url, cloud_url, key = args.edge, args.cloud, args.api_key
        else:
            procs, edge_url, cloud_url, key = start_tiers(args, work)
        return asyncio.run(collect(tasks, edge_url, args.edge_model, cloud_url, args.cloud_model, key,
                                   concurrency=args.concurrency, progress=tick))
    finally:
        for proc in procs:
            stop(proc)


def by_kind(samples: list) -> None:
    print(f"{'kind':<12} {'items':>5} {'edge right':>11} {'cloud right':>12} {'cloud better':>13} {'edge better':>12}")
    kinds = sorted({s.task.kind for s in samples})
    for kind in [*kinds, "all"]:
        ss = [s for s in samples if kind in ("all", s.task.kind)]
        e, c = sum(s.edge_score for s in ss) / len(ss), sum(s.cloud_score for s in ss) / len(ss)
        up = sum(s.cloud_score > s.edge_score for s in ss)
        down = sum(s.edge_score > s.cloud_score for s in ss)
        print(f"{kind:<12} {len(ss):>5} {e:>10.1%} {c:>11.1%} {up:>13} {down:>12}")


def report(samples: list, args) -> None:
    if args.fit_on:  # fitted on another run's answers (another seed), judged on every item of this one
        fit, held = sample_io.from_json(json.loads(Path(args.fit_on).read_text())), samples
        print(f"fitted on {len(fit)} items of {args.fit_on}, judged on all {len(held)} items here")
    else:
        fit, held = cal.split(samples, args.holdout, args.seed)
        print(f"{len(samples)} items ({len(fit)} to fit, {len(held)} held out, split seed {args.seed})")
    print(f"edge {args.edge_model} (llama.cpp), cloud {args.cloud_model} (our engine)\n")
    by_kind(samples)
    for weighted in (False, True):
        router, _ = fit_router(fit, args.target_escalation, args.window, args.edge_model, gap_weights=weighted)
        results, info = evaluate_router(fit, held, args.target_escalation, router)
        print(f"\nheld-out, target escalation {args.target_escalation:.0%}, K = {args.window}"
              f"{', samples weighted by gap' if weighted else ''}:")
        print_table(results, info, args.target_escalation)
    print("\nthe router at other targets (thresholds chosen on the fitting half):")
    print(f"{'target':>7} {'escalated':>10} {'before gen':>11} {'kept':>7}")
    q_c = cal.quality(held, [True] * len(held))
    for target in (0.1, 0.2, 0.3, 0.4, 0.5):
        router, _ = fit_router(fit, target, args.window, args.edge_model)
        results, info = evaluate_router(fit, held, target, router)
        r = results[-1]  # the router, two-stage
        print(f"{target:>7.0%} {r.escalation:>10.1%} {info['router_before']:>11.1%} {r.quality_kept:>7.1%}")
    print("\nan unseen kind: the router fitted without it, judged on its held-out items "
          "(full model's APGR; the kinds the generator has are never a feature):")
    for kind in sorted({s.task.kind for s in samples}):
        rest = [s for s in fit if s.task.kind != kind]
        mine = [s for s in held if s.task.kind == kind]
        if len(mine) < 10 or len(rest) < 50:
            continue
        r_wo, _ = fit_router(rest, args.target_escalation, args.window, args.edge_model)
        res, inf = evaluate_router(rest, mine, args.target_escalation, r_wo)
        full = next(r for r in res if r.name == "full")
        print(f"  {kind:<11} {len(mine):>4} held-out items, edge {inf['q_edge']:.2f} cloud {inf['q_cloud']:.2f}: "
              f"APGR {full.apgr:.3f}, router escalates {res[-1].escalation:.0%} keeping {res[-1].quality_kept:.1%}")
    costs = signal_costs(samples, router)
    print("\ncost per request on this machine (microseconds): "
          + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()))
    print(f"q_cloud {q_c:.3f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=400, help="items in the graded set")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--edge", help="a running edge agent's URL (default: start one)")
    p.add_argument("--cloud", help="a running cloud tier's URL (default: start one)")
    p.add_argument("--api-key", default="", help="the cloud key, with --cloud")
    p.add_argument("--edge-model", default="qwen2.5-coder-0.5b")
    p.add_argument("--cloud-model", default="qwen2.5-coder-1.5b")
    p.add_argument("--weight-dtype", default="int8", help="the cloud engine's weights, when started here")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--samples", help="fit on answers kept before (a samples JSON) instead of asking the tiers")
    p.add_argument("--out", default="router-samples.json", help="where the answers are kept")
    p.add_argument("--holdout", type=float, default=0.5)
    p.add_argument("--fit-on", help="fit on the answers in this samples JSON and judge on all of these")
    p.add_argument("--target-escalation", type=float, default=0.3)
    p.add_argument("--window", type=int, default=16, help="K: the hold-back tokens the router reads")
    p.add_argument("--record", type=int, default=32, help="tokens whose logprobs the started agent returns")
    args = p.parse_args()
    if bool(args.edge) != bool(args.cloud):
        p.error("give both --edge and --cloud, or neither")
    if args.samples:
        samples = sample_io.from_json(json.loads(Path(args.samples).read_text()))
    else:
        samples = collect_samples(args)
        Path(args.out).write_text(json.dumps(sample_io.to_json(samples), indent=1))
        print(f"answers kept in {args.out}", file=sys.stderr)
    report(samples, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
