"""Edge backends side by side: llama.cpp (the packaged SmolLM2 Q4_1 GGUF) versus the ONNX int4
and fp32 exports of the same model, through our API and on each runtime's own loop.

    .venv/bin/python bench/edge_backends.py [--onnx-int4 DIR] [--onnx-fp32 DIR] [--threads N]
        [--tokens 128] [--lengths 128,512] [--repeats 3] [--backends llama.cpp,onnx-int4,onnx-fp32]
        [--no-api] [--quick]

The same prompt token ids go to every runtime (counting prompts, so greedy decoding never meets
EOS), greedy, the same thread count for prompt and decode. "api" streams /v1/completions with
logprobs on from `cascade edge run --backend ...` started on a free port (one slot); "own" is
llama-cpp-python's Llama.create_completion or onnxruntime-genai's generate_next_token loop, each
in a process of its own so its resident memory is that runtime's alone (the agent's is the agent
process's: the runtime plus the server). Each request's prompt differs from the previous one in
its first tokens, so no row profits from prefix reuse, except the last two: a 400-token system
prompt seen for the first time (miss), then again with another question (hit). Without
--onnx-int4/--onnx-fp32 the exports are made once with cloud_tier.onnx_export into
~/.cache/cascade/bench-onnx. Goal: our ONNX backend >= 0.95x onnxruntime-genai's own loop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from cascade.processes import free_port, spawn, stop, wait_healthy
from cascade_cli.spawn import cascade_command

# before llama_cpp or onnxruntime load (in the workers): their threads read this once
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
REPO = Path(__file__).resolve().parent.parent
N_CTX = 1024
SYSTEM_WORDS = ("shipment warehouse customs invoice pallet carrier route manifest depot schedule courier "
                "parcel freight container dock tracking delivery window policy section").split()


# ---- prompts: token ids, made once with the export's tokenizer, the same for every runtime ----

def counting_prompt(encode, n_tokens: int, variant: int) -> list[int]:
    start = 1 + 1000 * variant
    text = f"List {variant}. Count on, one number after another: " + ", ".join(
        str(k) for k in range(start, start + n_tokens))
    return encode(text)[:n_tokens]


def system_prompts(encode, variant: int) -> tuple[list[int], list[int]]:
    """(system + question 1, system + question 2): the same 400-token system prompt."""
    words = [SYSTEM_WORDS[(i * 7 + variant * 13) % len(SYSTEM_WORDS)] for i in range(800)]
    system = encode(f"Policy book #{variant}: " + " ".join(words))[:400]
    return (system + encode(" Question: where is parcel 17 now? Answer:"),
            system + encode(" Question: when does the depot open? Answer:"))


def make_prompts(export: Path, lengths: list[int], repeats: int) -> dict:
    import onnxruntime_genai as og

    tok = og.Tokenizer(og.Model(og.Config(str(export))))

    def encode(text: str) -> list[int]:
        return [int(t) for t in tok.encode(text)]

    return {"lengths": {str(n): [counting_prompt(encode, n, r) for r in range(repeats)] for n in lengths},
            "prefix": [system_prompts(encode, r) for r in range(repeats)]}


# ---- timings -----------------------------------------------------------------------------------

def run_stats(prompt_tokens: int, start: float, times: list[float]) -> dict:
    """One request: TTFT, prefill and decode rates, the gaps between tokens."""
    ttft = times[0] - start
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"prompt_tokens": prompt_tokens, "tokens": len(times), "ttft_s": ttft,
            "prefill_tok_s": prompt_tokens / ttft, "decode_tok_s": len(gaps) / sum(gaps) if gaps else None,
            "gaps": gaps}


def summarize(runs: list[dict]) -> dict:
    """Medians over repeats; inter-token percentiles over every gap of every repeat."""
    gaps = sorted(g for r in runs for g in r["gaps"])
    pct = (lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1000) if gaps else (lambda q: None)
    decode = [r["decode_tok_s"] for r in runs if r["decode_tok_s"]]
    return {"ttft_ms": statistics.median(r["ttft_s"] for r in runs) * 1000,
            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
            "decode_tok_s": statistics.median(decode) if decode else None,
            "itl_p50_ms": pct(0.5), "itl_p95_ms": pct(0.95), "tokens": min(r["tokens"] for r in runs)}


# ---- each runtime's own loop (run in a worker process: python bench/edge_backends.py --worker) ----

class LlamaLoop:
    def __init__(self, path: str, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads, n_batch=256,
                         verbose=False)

    def generate(self, ids: list[int], max_tokens: int) -> dict:
        start, times = time.perf_counter(), []
        # llama-cpp-python keeps the previous prompt's KV and evaluates only what differs
        for chunk in self.llm.create_completion(ids, max_tokens=max_tokens, temperature=0.0, stream=True):
            if chunk["choices"][0]["finish_reason"] is None or chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
        return run_stats(len(ids), start, times)


class OnnxLoop:
    """onnxruntime-genai's own loop: append_tokens, then generate_next_token until max_tokens. One
    generator (max_length = the agent's slot context) rewound to the common prefix between
    requests, as a user of rewind_to would do it."""

    def __init__(self, path: str, threads: int):
        import onnxruntime_genai as og

        self.og = og
        cfg = og.Config(path)
        cfg.clear_providers()
        cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(cfg)
        self.gen, self.seq = None, []

    def generate(self, ids: list[int], max_tokens: int) -> dict:
        import numpy as np

        if self.gen is None:
            params = self.og.GeneratorParams(self.model)
            params.set_search_options(max_length=N_CTX, do_sample=False)
            self.gen = self.og.Generator(self.model, params)
        common = 0
        while common < min(len(ids), len(self.seq)) - 1 and ids[common] == self.seq[common]:
            common += 1
        start, times = time.perf_counter(), []
        self.gen.rewind_to(common)
        self.gen.append_tokens(np.array(ids[common:], dtype=np.int32))
        while len(times) < max_tokens and not self.gen.is_done():
            self.gen.generate_next_token()
            times.append(time.perf_counter())
        self.seq = [int(t) for t in self.gen.get_sequence(0)]
        return run_stats(len(ids), start, times)


def worker(args) -> int:
    prompts = json.loads(Path(args.prompts).read_text())
    loop = (LlamaLoop if args.worker == "llama.cpp" else OnnxLoop)(args.model, args.threads)
    # VmHWM, not ru_maxrss: that one carries over the parent's peak across fork and exec
    print(json.dumps(measure(loop.generate, prompts, args.tokens) | {"rss_peak_bytes": peak_rss(os.getpid())}))
    return 0


def measure(generate, prompts: dict, max_tokens: int) -> dict:
    generate(prompts["lengths"][next(iter(prompts["lengths"]))][0][:32], 8)  # warm-up
    rows = {n: summarize([generate(ids, max_tokens) for ids in runs]) for n, runs in prompts["lengths"].items()}
    miss, hit = [], []
    for first, second in prompts["prefix"]:
        miss.append(generate(first, 8))
        hit.append(generate(second, 8))
    return {"rows": rows, "prefix_miss": summarize(miss), "prefix_hit": summarize(hit)}


def own_loop(kind: str, model: str, prompts_file: Path, threads: int, tokens: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--model", model, "--prompts", str(prompts_file),
           "--threads", str(threads), "--tokens", str(tokens)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=3600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise RuntimeError(f"{kind} worker failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- through our API ---------------------------------------------------------------------------

@contextlib.contextmanager
def edge_agent(home: Path, *args: str) -> Iterator[tuple[str, int]]:
    port = free_port()
    log = home / f"edge-{port}.log"
    proc = spawn(cascade_command("edge", "run", "--no-config", "--port", str(port), "--parallel", "1",
                                 "--n-ctx", str(N_CTX), *args), env={"CASCADE_HOME": str(home)}, log=log, cwd=REPO)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 300, "edge agent", log=log)
        yield url, proc.pid
    finally:
        stop(proc)


def peak_rss(pid: int) -> int | None:
    status = Path(f"/proc/{pid}/status").read_text()
    line = next((x for x in status.splitlines() if x.startswith("VmHWM:")), None)
    return int(line.split()[1]) * 1024 if line else None


def via_api(backend_args: list[str], prompts: dict, threads: int, tokens: int) -> dict:
    home = Path(tempfile.mkdtemp(prefix="cascade-bench-"))
    with edge_agent(home, *backend_args, "--threads", str(threads), "--threads-batch", str(threads)) as (url, pid), \
            httpx.Client(timeout=600) as client:
        model = client.get(f"{url}/v1/models").json()["data"][0]["id"]

        def generate(ids: list[int], max_tokens: int) -> dict:
            body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
                    "stream": True, "cascade": {"mode": "local"}}
            start, times = time.perf_counter(), []
            with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"agent answered {r.status_code}: {r.read()[:500]!r}")
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                    n = len((choice.get("logprobs") or {}).get("tokens") or []) or (1 if choice.get("text") else 0)
                    times += [time.perf_counter()] * n
            return run_stats(len(ids), start, times)

        result = measure(generate, prompts, tokens)
        return result | {"rss_peak_bytes": peak_rss(pid)}


# ---- the table ---------------------------------------------------------------------------------

def fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(results: dict, args, load_before, load_after) -> None:
    cores = os.cpu_count()
    print(f"\nSmolLM2-135M-Instruct: {args.tokens} tokens generated, greedy, {args.threads} threads (prompt and "
          f"decode), {args.repeats} repeats (medians), {cores} cores, load average "
          f"{load_before[0]:.1f} before / {load_after[0]:.1f} after\n")
    head = (f"{'backend':<10} {'path':<4} {'prompt':>8} | {'TTFT ms':>8} {'prefill t/s':>11} {'decode t/s':>10} "
            f"{'ITL p50':>7} {'p95 ms':>7} | {'peak RSS MB':>11}")
    print(head)
    print("-" * len(head))
    for (backend, path), r in results.items():
        rss = fmt(r["rss_peak_bytes"] / 1e6, ".0f") if r.get("rss_peak_bytes") else "-"
        rows = [(n, s) for n, s in r["rows"].items()] + [("sys miss", r["prefix_miss"]), ("sys hit", r["prefix_hit"])]
        for label, s in rows:
            print(f"{backend:<10} {path:<4} {label:>8} | {fmt(s['ttft_ms']):>8} {fmt(s['prefill_tok_s'], '.0f'):>11} "
                  f"{fmt(s['decode_tok_s']):>10} {fmt(s['itl_p50_ms']):>7} {fmt(s['itl_p95_ms']):>7} | {rss:>11}")
    print("\nratios (decode tok/s; TTFT of the longest prompt):")
    longest = str(max(int(n) for n in next(iter(results.values()))["rows"]))
    pairs = [((b, "api"), (b, "own"), f"ours {b} / its own loop") for b in args.backends]
    pairs += [((b, "api"), ("llama.cpp", "api"), f"ours {b} / ours llama.cpp") for b in args.backends
              if b != "llama.cpp"]
    for a, b, label in pairs:
        if a in results and b in results:
            ra, rb = results[a]["rows"][longest], results[b]["rows"][longest]
            dec = ra["decode_tok_s"] / rb["decode_tok_s"] if ra["decode_tok_s"] and rb["decode_tok_s"] else None
            print(f"  {label:<34} decode {fmt(dec, '.3f')}x   TTFT {ra['ttft_ms'] / rb['ttft_ms']:.3f}x")
    print("\nsys miss/hit: a 400-token system prompt + question, 8 tokens; hit = the same system prompt, "
          "another question (prefix reuse)")


def default_export(precision: str) -> Path:
    from cloud_tier.onnx_export import export_onnx

    out = Path.home() / ".cache" / "cascade" / "bench-onnx" / f"smollm2-135m-{precision}"
    if not (out / "cascade_model.json").is_file():
        print(f"exporting smollm2-135m {precision} to {out} ...", file=sys.stderr)
        export_onnx("smollm2-135m", out, precision=precision, target="cpu", verify=False, force=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--onnx-int4", help="an int4 export directory (default: export one)")
    ap.add_argument("--onnx-fp32", help="an fp32 export directory (default: export one)")
    ap.add_argument("--threads", type=int, default=0, help="threads of every runtime, prompt and decode "
                    "(default: cores - 1 up to 4 cores, else every core: the llama.cpp agent's decode default)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--lengths", default="128,512", help="prompt lengths in tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="llama.cpp,onnx-int4,onnx-fp32")
    ap.add_argument("--no-api", action="store_true", help="each runtime's own loop only")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 128-token prompts, 32 tokens, 1 repeat")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    args.threads = args.threads or (max(1, cores - 1) if cores <= 4 else cores)
    if args.worker:
        return worker(args)
    if args.quick:
        args.lengths, args.tokens, args.repeats = "128", 32, 1
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    lengths = [int(n) for n in args.lengths.split(",")]

    from model_distribution.artifacts.catalog import Catalog

    home = Path(tempfile.mkdtemp(prefix="cascade-bench-"))
    gguf = str(Catalog(home).get("smollm2-135m").path)
    exports = {}
    if "onnx-int4" in args.backends:
        exports["onnx-int4"] = Path(args.onnx_int4) if args.onnx_int4 else default_export("int4")
    if "onnx-fp32" in args.backends:
        exports["onnx-fp32"] = Path(args.onnx_fp32) if args.onnx_fp32 else default_export("fp32")
    prompts = make_prompts(next(iter(exports.values())) if exports else default_export("int4"), lengths,
                           args.repeats)
    prompts_file = home / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))

    load_before = os.getloadavg()
    results = {}
    for backend in args.backends:
        model = gguf if backend == "llama.cpp" else str(exports[backend])
        kind = "llama.cpp" if backend == "llama.cpp" else "onnx"
        print(f"{backend}: own loop ...", file=sys.stderr)
        results[(backend, "own")] = own_loop(kind, model, prompts_file, args.threads, args.tokens)
        if not args.no_api:
            print(f"{backend}: through the agent ...", file=sys.stderr)
            results[(backend, "api")] = via_api(["--backend", kind, "--model", model], prompts, args.threads,
                                                args.tokens)
    print_table(results, args, load_before, os.getloadavg())
    if args.json:
        Path(args.json).write_text(json.dumps({f"{b} {p}": r for (b, p), r in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
