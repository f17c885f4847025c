"""``cascade calibrate``: run the edge and the cloud model on a prompt set, score both, choose
the escalation threshold that hits a target rate (``cascade.eval.calibration``), write it into
the edge config, and plot quality kept against escalation rate (with random routing for
comparison). The signal with the larger held-out APGR is written into the config as the fallback
thresholds, and the two-stage router (cascade.policy.router, fitted by cascade.eval.router_fit on
the same half) as ``[cascade] router``: the agent uses it while it serves the model it was
calibrated for (name and GGUF sha256), the thresholds otherwise.

This module holds the parser and the steps in order; the tiers are asked in tiers.py, the prompt
sets read in prompts.py, the results shown by report.py (all imported when the command runs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cascade_cli.parsing import add_command


class _Stop(Exception):
    """The command cannot go on: one line on stderr and the exit status."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def _edge_config(args):
    """(the edge.toml to write, the edge config it holds now: built-in defaults when missing)."""
    from cascade.config import ConfigError, cascade_home
    from edge_agent.config import EdgeConfig

    config_path = Path(args.config) if args.config else cascade_home() / "edge.toml"
    try:
        return config_path, EdgeConfig.load(config_path if config_path.is_file() else None)
    except ConfigError as e:
        raise _Stop(str(e), 2) from e


def _tiers(args, edge_cfg) -> tuple[str, str, str, str]:
    """(cloud URL, cloud key, edge model, cloud model): both tiers are asked first, so that one not
    running is named with how to start it."""
    from cascade_cli.calibrate.tiers import Unreachable, served_model

    cloud_url = args.cloud or edge_cfg.upstream.url
    if not cloud_url:
        raise _Stop("no cloud to compare with: pass --cloud URL or set [upstream] url", 2)
    key = args.api_key if args.api_key is not None else edge_cfg.upstream.api_key
    try:
        edge_model = served_model(args.edge, {}, "the edge agent",
                                  "start it with `cascade edge run` (or pass --edge URL)")
        cloud_model = served_model(cloud_url, {"authorization": f"Bearer {key}"} if key else {}, "the cloud tier",
                                   "start it with `cascade cloud serve` (or pass --cloud URL, or set [upstream] url)")
    except Unreachable as e:
        raise _Stop(str(e), 1) from e
    return cloud_url, key, args.edge_model or edge_model, args.cloud_model or edge_cfg.upstream.model or cloud_model


def _answers(args, edge_model: str, cloud_url: str, cloud_model: str, key: str) -> list:
    """Every prompt answered by both tiers and scored, with progress on stderr."""
    import asyncio

    import httpx

    from cascade_cli.calibrate.prompts import load_prompts
    from cascade_cli.calibrate.tiers import collect

    try:
        tasks = load_prompts(args.prompts, args.num_prompts, args.seed)
        done = [0]

        def tick():
            done[0] += 1
            if done[0] % 50 == 0 or done[0] == len(tasks):
                print(f"  {done[0]}/{len(tasks)} prompts answered by both tiers", file=sys.stderr)
        return asyncio.run(collect(tasks, args.edge, edge_model, cloud_url, cloud_model, key,
                                   args.max_tokens, args.concurrency, tick))
    except httpx.HTTPError as e:
        try:
            where = e.request.url
        except RuntimeError:  # an error httpx raised before it had a request
            where = "?"
        raise _Stop(f"calibration failed at {where}: {type(e).__name__}: {e}", 1) from e
    except (OSError, KeyError, IndexError, TypeError, ValueError) as e:
        raise _Stop(f"calibration failed: {e!r}", 1) from e


def _write(samples: list, results: list, best, info: dict, config_path: Path, out_dir: Path) -> dict:
    """The difficulty model, the router, the samples, and the best signal's [cascade] keys into the
    edge config; the keys written."""
    import math

    from cascade.config import write_section
    from cascade.eval.samples import to_json
    from cascade.policy.router import Router

    Router.from_json(info["router"].to_json())  # what the agent will load: RouterError (named), nothing written
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = out_dir / "difficulty.json"
    model_path.write_text(json.dumps(info["difficulty_model"], indent=2))
    router_path = out_dir / "router.json"
    router_path.write_text(json.dumps(info["router"].to_json(), indent=1))
    updates = {"difficulty_model": str(model_path), "router": str(router_path)}
    if best.name == "confidence":
        updates.update(min_mean_logprob=-best.threshold, difficulty_threshold=1.01)
    else:
        updates.update(difficulty_threshold=best.threshold, min_mean_logprob=-math.inf)
    write_section(config_path, "cascade", updates)
    (out_dir / "samples.json").write_text(json.dumps(to_json(samples), indent=1))
    return updates


def cmd_calibrate(args) -> int:
    """``cascade calibrate``: the exit status."""
    import math

    from cascade.config import cascade_home
    from cascade.eval import calibration as cal
    from cascade.eval.router_eval import evaluate_router, print_table
    from cascade.eval.router_fit import fit_router
    from cascade_cli.calibrate import report
    from cascade_cli.calibrate.tiers import edge_sha256

    try:
        config_path, edge_cfg = _edge_config(args)
        cloud_url, key, edge_model, cloud_model = _tiers(args, edge_cfg)
        samples = _answers(args, edge_model, cloud_url, cloud_model, key)
    except _Stop as e:
        print(f"cascade: {e}", file=sys.stderr)
        return e.exit_code
    calib, held = cal.split(samples, args.holdout, args.seed)
    results, info = cal.evaluate(calib, held, args.target_escalation)
    best = max(results, key=lambda r: -1 if math.isnan(r.apgr) else r.apgr)
    router, _ = fit_router(calib, args.target_escalation, edge_cfg.cascade.hold_tokens, edge_model,
                           edge_sha256(args.edge))
    signals, router_info = evaluate_router(calib, held, args.target_escalation, router)
    info["router"] = router
    out_dir = cascade_home() / "calibration"
    try:
        updates = _write(samples, results, best, info, config_path, out_dir)
    except ValueError as e:  # a router the agent could not load: nothing of it is written
        print(f"cascade: calibration failed: {e}", file=sys.stderr)
        return 1
    plot_path = Path(args.plot) if args.plot else out_dir / "calibration.png"
    shown = [r for r in signals if r.name in ("old confidence", "old difficulty", "prompt-only", "full", "router")]
    report.plot(shown, info["q_edge"], info["q_cloud"], args.target_escalation, plot_path)
    print(f"{len(samples)} prompts ({len(calib)} to fit, {len(held)} held out); edge {edge_model} @ {args.edge}, "
          f"cloud {cloud_model} @ {cloud_url}")
    report.print_results(results, best, info["q_edge"], info["q_cloud"], args.target_escalation)
    print()
    print_table(signals, router_info, args.target_escalation)
    print(f"router (written): before generating above {router.stage1_threshold:.4f}, after {router.window} tokens "
          f"above {router.stage2_threshold:.4f}; calibrated for {router.edge_model}"
          + (f" (sha256 {router.edge_sha256[:12]}...)" if router.edge_sha256 else " (no GGUF sha256 from the agent)"))
    print(f"wrote [cascade] {', '.join(f'{k}={v}' for k, v in updates.items())} to {config_path}")
    print(f"plot: {plot_path}")
    print(f"apply it: cascade edge run --config {config_path}  (an agent running now keeps its old thresholds "
          "until restarted with that config)")
    return 0


def add_calibrate_parser(sub) -> None:
    """``cascade calibrate``."""
    calib = add_command(sub, "calibrate", "choose the cascade's escalation thresholds from a prompt set and write "
                                          "them into the edge config")
    calib.add_argument("--prompts", default="tasks", help="tasks (generated, with answers), sharegpt, or a file "
                       "(JSON lines with prompt/answer, or one prompt per line)")
    calib.add_argument("--num-prompts", "-n", type=int, default=600, help="prompts to run")
    calib.add_argument("--target-escalation", type=float, default=0.3,
                       help="share of requests to escalate, 0..1")
    calib.add_argument("--holdout", type=float, default=0.5, help="share of prompts held out to judge")
    calib.add_argument("--edge", default="http://127.0.0.1:8081", help="the edge agent to calibrate")
    calib.add_argument("--edge-model", help="default: the agent's model")
    calib.add_argument("--cloud", help="the cloud tier's URL (default: [upstream] url)")
    calib.add_argument("--api-key", help="the cloud key (default: [upstream] api_key)")
    calib.add_argument("--cloud-model", help="default: [upstream] model, else the cloud's first model")
    calib.add_argument("--config", help="the edge.toml to write (default: $CASCADE_HOME/edge.toml)")
    calib.add_argument("--plot", help="PNG path (default: $CASCADE_HOME/calibration/calibration.png)")
    calib.add_argument("--max-tokens", type=int, default=0, help="tokens per answer (default 0: each task "
                       "kind's own, e.g. 128 for code, 32 for short answers)")
    calib.add_argument("--concurrency", type=int, default=4, help="prompts in flight")
    calib.add_argument("--seed", type=int, default=0, help="for sampling prompts and the split")
    calib.set_defaults(func=cmd_calibrate)
