"""Serving: `cascade cloud serve --both 1` against `vllm serve`, same weights, same run, measured by a
client neither of us wrote: vLLM's own `vllm bench serve` (ShareGPT, Poisson arrivals at each rate,
streamed chat, greedy with ignore_eos so every request generates --output-len tokens).

    .venv/bin/python bench/serve_vs_vllm.py [--num-prompts 100] [--output-len 128] [--rates 1,4,inf]
        [--repeat 1] [--dtype bfloat16] [--goodput-ttft-ms 2000 --goodput-tpot-ms 200] [--plot serve.png]
        [--vllm-python ~/.cache/cascade/vllm-venv/bin/python] [--out results.json]

With --repeat 1 each server gets the machine alone (one runs while the other is stopped). With
--repeat N > 1 both stay up and the runs interleave (rate 1: vLLM, ours; rate 4: vLLM, ours; ...;
then again, the order of the two swapped each round), so a slow spell of a shared VM falls on both;
the tables give each figure's median over the rounds, each round's ratios, and the CPU seconds the
idle server used while the other ran. The same max_num_seqs and model dtype for both; prefix
caching on in both (the ShareGPT prompts share little). Prints TTFT and TPOT p50/p99, throughput and
goodput (requests meeting both targets per second, vLLM's --goodput) per rate and system, and the
ratios; the goal of issue 17 is ours at or below vLLM's TTFT/TPOT p50/p99 at every rate. --plot
writes a PNG of the four latency figures by rate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# run as `.venv/bin/python bench/serve_vs_vllm.py`: sys.path[0] is bench/, so its sibling module
# imports by its bare name
from gateway_vllm import MODEL, client_args, cpu_seconds, run_client, write_sharegpt

from cascade.processes import free_port, spawn, stop, wait_healthy
from cascade_cli.spawn import cascade_command
from cloud_tier.worker.processes import worker_omp_env

# the figures here are about SmolLM2-135M (the defaults are the Qwen tier pair): every server started here serves it
os.environ.setdefault("CASCADE_EDGE_MODEL_NAME", "smollm2-135m")
os.environ.setdefault("CASCADE_CLOUD_ENGINE_MODEL", "smollm2-135m")

REPO = Path(__file__).resolve().parent.parent
FIGURES = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms")


def start_vllm(args, model_dir: Path, work: Path) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
           "--max-model-len", "2048", "--max-num-seqs", str(args.max_num_seqs)]
    # the OpenMP wait policy our worker gets (cloud_tier.worker.processes.worker_omp_env)
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_NO_USAGE_STATS": "1", **worker_omp_env(os.cpu_count() or 1)}
    return spawn(cmd, env=env, log=work / "vllm.log", cwd=work), f"http://127.0.0.1:{port}", "unused"


def start_cascade(args, work: Path) -> tuple[subprocess.Popen, str, str]:
    """The gateway and one co-located worker; the gateway's own admission limits raised, so the
    engine's scheduler is what is measured (vLLM has no gateway in front)."""
    port = free_port()
    env = {"CASCADE_HOME": str(work), "CASCADE_CLOUD_GATEWAY_DB": str(work / "gateway.db"),
           "CASCADE_CLOUD_GATEWAY_RESULT_CACHE_TTL_S": "0.001", "CASCADE_CLOUD_GATEWAY_MAX_QUEUE": "100000",
           "CASCADE_CLOUD_GATEWAY_TTFT_SLO_S": "600", "CASCADE_CLOUD_ENGINE_DTYPE": args.dtype,
           "CASCADE_CLOUD_ENGINE_MAX_NUM_SEQS": str(args.max_num_seqs), "OMP_WAIT_POLICY": "passive"}
    out = subprocess.run(cascade_command("cloud", "keys", "create", "--tenant", "bench"),
                         env={**os.environ, **env}, capture_output=True, text=True, check=True).stdout
    key = out.strip().splitlines()[-1]
    proc = spawn(cascade_command("cloud", "serve", "--port", str(port), "--both", "1", "--max-model-len", "2048"),
                 env=env, log=work / "cascade.log", cwd=REPO)
    return proc, f"http://127.0.0.1:{port}", key


def start(args, system: str, model_dir: Path, work: Path) -> tuple[subprocess.Popen, str, str]:
    print(f"== {system}: starting (work directory {work})", flush=True)
    proc, url, key = start_vllm(args, model_dir, work) if system == "vllm" else start_cascade(args, work)
    try:
        wait_healthy(url, proc, 900, system, path="/health" if system == "vllm" else "/healthz",
                     log=work / f"{system}.log")
    except BaseException:
        stop(proc, timeout_s=30)
        raise
    return proc, url, key


def run_apart(args, systems: list[str], rates: list[str], common: list[str], model_dir: Path,
              work: Path) -> list[dict]:
    """One server at a time: each gets the whole machine."""
    results = []
    for system in systems:
        proc, url, key = start(args, system, model_dir, work)
        try:
            results += [{**r, "round": 0} for r in run_client(
                args, common, [{"path": system, "url": url, "rate": r, "key": key} for r in rates], work)]
        finally:
            stop(proc, timeout_s=30)
    return results


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every live descendant (a server's workers and
    engine processes), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += cpu_seconds(p)
        except (OSError, ValueError, IndexError):
            continue
        todo += children.get(p, [])
    return total


def run_interleaved(args, systems: list[str], rates: list[str], common: list[str], model_dir: Path,
                    work: Path) -> list[dict]:
    """Both servers up; per round and rate each system in turn (the order swapped every round), in
    one client process. Each result records the CPU seconds the idle servers used since the result
    before it (what they took from the one measured)."""
    up: dict[str, tuple[subprocess.Popen, str, str]] = {}
    try:
        for system in systems:
            up[system] = start(args, system, model_dir, work)
        runs = [{"path": system, "url": up[system][1], "rate": rate, "key": up[system][2], "round": rnd}
                for rnd in range(args.repeat) for rate in rates
                for system in (systems if rnd % 2 == 0 else systems[::-1])]
        last = {s: tree_cpu_seconds(p.pid) for s, (p, _, _) in up.items()}

        def on_result(r: dict) -> None:
            now = {s: tree_cpu_seconds(p.pid) for s, (p, _, _) in up.items()}
            r["idle_cpu_s"] = sum(now[s] - last[s] for s in up if s != r["path"])
            last.update(now)

        results = run_client(args, common, runs, work, on_result)
        for run, r in zip(runs, results, strict=True):
            r["round"] = run["round"]
        return results
    finally:
        for proc, _, _ in up.values():
            stop(proc, timeout_s=30)


def medians(rounds: list[dict]) -> list[dict]:
    """Per (rate, system): each figure's median over the rounds (the round itself with one)."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in rounds:
        by.setdefault((r["rate"], r["path"]), []).append(r)
    out = []
    for (rate, path), rs in by.items():
        if len(rs) == 1:
            out.append(rs[0])
            continue
        m = {"rate": rate, "path": path, "errors": sorted({e for r in rs for e in r.get("errors", [])})[:3]}
        for k in (*FIGURES, "output_throughput", "request_goodput", "completed", "failed"):
            vals = [r[k] for r in rs if isinstance(r.get(k), int | float)]
            if vals:
                m[k] = statistics.median(vals)
        out.append(m)
    return out


def print_rounds(rounds: list[dict], rates: list[str]) -> None:
    """Each round's ours/vLLM ratios: how much of a difference the noise between rounds makes."""
    by = {(r["round"], r["rate"], r["path"]): r for r in rounds}
    n = 1 + max(r["round"] for r in rounds)
    print(f"\n{'round':>5} {'rate':>5} " + " ".join(f"{k.replace('_ms', ''):>10}" for k in FIGURES)
          + f" {'idle CPU s':>11}")
    for rnd in range(n):
        for rate in rates:
            v, c = by.get((rnd, rate, "vllm")), by.get((rnd, rate, "cascade"))
            if v is None or c is None:
                continue
            ratios = [c[k] / v[k] if v.get(k) else math.nan for k in FIGURES]
            idle = f"{v.get('idle_cpu_s', math.nan):.1f}/{c.get('idle_cpu_s', math.nan):.1f}"
            print(f"{rnd:>5} {rate:>5} " + " ".join(f"{x:>9.2f}x" for x in ratios) + f" {idle:>11}")
    print("(idle CPU s: seconds the idle server used during vLLM's run / during ours)")


def print_table(results: list[dict], rates: list[str]) -> None:
    by = {(r["rate"], r["path"]): r for r in results}
    print(f"\n{'rate':>5} {'system':<8} {'ok':>4} {'fail':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
          f"{'TPOT p99':>9} {'out tok/s':>9} {'goodput':>8}")
    for rate in rates:
        for path in ("vllm", "cascade"):
            r = by.get((rate, path))
            if r is None:
                continue
            print(f"{rate:>5} {path:<8} {r['completed']:>4} {r['failed']:>4} "
                  + " ".join(f"{r.get(k, math.nan):>9.1f}" for k in FIGURES)
                  + f" {r['output_throughput']:>9.1f} {r.get('request_goodput', math.nan):>8.2f}")
    print(f"\n{'rate':>5} " + " ".join(f"{k.replace('_ms', ''):>13}" for k in FIGURES) + f" {'throughput':>11}")
    for rate in rates:
        v, c = by.get((rate, "vllm")), by.get((rate, "cascade"))
        if v is None or c is None:
            continue
        ratios = [c[k] / v[k] if v.get(k) else math.nan for k in FIGURES]
        tput = c["output_throughput"] / v["output_throughput"] if v["output_throughput"] else math.nan
        print(f"{rate:>5} " + " ".join(f"{x:>12.2f}x" for x in ratios) + f" {tput:>10.2f}x")
    print("(latency ratios: ours / vLLM's, goal <= 1.00 at every rate; throughput: ours / vLLM's)")
    for r in results:
        for e in r.get("errors", []):
            print(f"error ({r['path']}, rate {r['rate']}): {e[:300]}")


def plot(results: list[dict], rates: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, key in zip(axes, FIGURES, strict=True):
        for system in ("vllm", "cascade"):
            ys = [next((r.get(key, math.nan) for r in results if r["rate"] == rate and r["path"] == system),
                       math.nan) for rate in rates]
            ax.plot(rates, ys, marker="o", label=system)
        ax.set_title(key.replace("_ms", " (ms)").replace("_", " "))
        ax.set_xlabel("request rate (req/s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rates", default="1,4,inf", help="comma-separated requests/s (inf: all at once)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--goodput-ttft-ms", type=float, default=2000.0)
    p.add_argument("--goodput-tpot-ms", type=float, default=200.0)
    p.add_argument("--systems", default="vllm,cascade")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds; above 1 both servers stay up and the runs interleave (medians reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", default=str(Path.home() / ".cache/cascade/vllm-venv/bin/python"))
    p.add_argument("--plot", help="write a PNG of TTFT/TPOT p50/p99 by rate here")
    p.add_argument("--out", help="write every run's numbers as JSON here")
    args = p.parse_args()
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not Path(args.vllm_python).exists():
        print(f"vLLM is not installed ({args.vllm_python} missing): bash scripts/install-vllm.sh", file=sys.stderr)
        return 2
    from model_distribution.artifacts.model_dirs import resolve_model_dir

    model_dir = resolve_model_dir(MODEL)
    work = Path(tempfile.mkdtemp(prefix="serve-vs-vllm-"))
    dataset = work / "sharegpt.json"
    write_sharegpt(dataset, max(2000, 20 * args.num_prompts))
    common = client_args(args, model_dir, dataset) + [
        "--goodput", f"ttft:{args.goodput_ttft_ms:g}", f"tpot:{args.goodput_tpot_ms:g}"]
    run = run_apart if args.repeat <= 1 else run_interleaved
    rounds = run(args, systems, rates, common, model_dir, work)
    print(f"\n{args.num_prompts} ShareGPT prompts, {args.output_len} output tokens each (greedy, ignore_eos), "
          f"{MODEL} {args.dtype}, {os.cpu_count()} cores; client: vllm bench serve (openai-chat, streamed); "
          f"goodput: TTFT <= {args.goodput_ttft_ms:g} ms and TPOT <= {args.goodput_tpot_ms:g} ms")
    results = medians(rounds)
    print_table(results, rates)
    if args.repeat > 1:
        print_rounds(rounds, rates)
    if args.plot:
        plot(results, rates, args.plot)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
