"""Edge agent overhead: tokens/s and time to first token through the agent's HTTP API versus
llama-cpp-python called directly, same model, same prompts, same run.

    .venv/bin/python bench/edge_overhead.py [--model qwen2.5-coder-0.5b] [--tokens 128] [--requests 8]

Rows: one stream at a time, and 4 requests in flight. The direct side mirrors the agent's
slots: `--parallel` llama.cpp contexts, each driven by its own thread (llama-cpp-python's
`Llama` is not thread-safe, so one object cannot serve two requests at once). Prints a table
and the agent/direct ratios; the goal is >= 0.97x throughput and < 15 ms TTFT overhead.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from cascade.processes import free_port, spawn, stop, wait_healthy
from cascade_cli.spawn import cascade_command

# the figures here are about SmolLM2-135M (the defaults are the Qwen tier pair): every server started here serves it
os.environ.setdefault("CASCADE_EDGE_MODEL_NAME", "smollm2-135m")
os.environ.setdefault("CASCADE_CLOUD_ENGINE_MODEL", "smollm2-135m")

# before llama_cpp loads (lazily, in main): its OpenMP threads read this once
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def edge_agent(home: Path, *args: str, timeout_s: float = 180) -> Iterator[str]:
    """`cascade edge run ARGS` on a free loopback port, $CASCADE_HOME ``home``, its log there:
    its URL once healthy; stopped (with its process group) on the way out."""
    port = free_port()
    log = home / f"edge-{port}.log"
    proc = spawn(cascade_command("edge", "run", "--port", str(port), *args),
                 env={"CASCADE_HOME": str(home)}, log=log, cwd=REPO)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, timeout_s, "edge agent", log=log)
        yield url
    finally:
        stop(proc)


def prompts(n: int, offset: int) -> list[str]:
    """Counting prompts: the model keeps counting, so every request generates all its tokens
    (a story prompt often ends at EOS after a few tokens and measures nothing)."""
    return [", ".join(str(k) for k in range(10 * (i + offset), 10 * (i + offset) + 4)) + ","
            for i in range(n)]


def direct_one(llm, prompt: str, max_tokens: int) -> tuple[float, int, float]:
    start = time.perf_counter()
    first = None
    n = 0
    for chunk in llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0,
                                       stream=True):
        choice = chunk["choices"][0]
        if choice["finish_reason"] is None or choice["text"]:  # the last chunk may carry no token
            first = first or time.perf_counter()
            n += 1
    end = time.perf_counter()
    return (first or end) - start, n, end - start


_http = threading.local()


def agent_one(url: str, prompt: str, max_tokens: int) -> tuple[float, int, float]:
    """One streamed completion over a kept-alive connection (one client per thread), as an app
    using the openai package would send it."""
    client = getattr(_http, "client", None) or httpx.Client(timeout=300)
    _http.client = client
    body = {"model": os.environ["CASCADE_EDGE_MODEL_NAME"], "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    n = 0
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return (first or end) - start, n, end - start


class FifoSlots:
    """Slots handed out strictly first come, first served, as the agent's queue does
    (queue.Queue lets a thread that just put a slot back take it again ahead of waiters)."""

    def __init__(self, slots: list):
        self._free = list(slots)
        self._waiters: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._free and not self._waiters:
                return self._free.pop()
            box: list = []
            ready = threading.Event()
            self._waiters.append((box, ready))
        ready.wait()
        return box[0]

    def put(self, slot) -> None:
        with self._lock:
            if self._waiters:
                box, ready = self._waiters.popleft()
                box.append(slot)
                ready.set()
            else:
                self._free.append(slot)


def run_load(fn, slots: list, items: list[str], concurrency: int) -> dict:
    """Run ``items`` with ``concurrency`` in flight; a request holds one of ``slots`` while it
    runs, and waits FIFO for one when all are taken."""
    free = FifoSlots(slots)

    def job(prompt):
        arrived = time.perf_counter()
        slot = free.get()
        try:
            waited = time.perf_counter() - arrived
            ttft, n, total = fn(slot, prompt)
            return ttft + waited, n, total + waited
        finally:
            free.put(slot)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(job, items))
    wall = time.perf_counter() - start
    tokens = sum(r[1] for r in results)
    return {"tok_s": tokens / wall, "ttft_ms": statistics.median(r[0] for r in results) * 1000,
            "tokens": tokens}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--model", default="smollm2-135m", help="a catalogue name (e.g. qwen2.5-coder-0.5b)")
    args = ap.parse_args()
    os.environ["CASCADE_EDGE_MODEL_NAME"] = args.model  # the agents started here serve it

    from llama_cpp import Llama

    from model_distribution.artifacts.catalog import Catalog

    home = Path(tempfile.mkdtemp(prefix="cascade-bench-"))
    catalog = Catalog(home)
    path = str(catalog.ensure_ready(catalog.get(args.model)))
    cores = os.cpu_count() or 1
    # (requests in flight, slots, decode threads, prompt threads); the first is the agent's default
    configs = [(1, 1, max(1, cores - 1), cores), (1, 1, cores, cores), (4, 2, 1, 1)]
    rows = []
    for concurrency, parallel, threads, threads_batch in configs:
        items = prompts(args.requests, offset=len(rows) * 100)
        warm = prompts(1, offset=999)[0]
        llms = [Llama(model_path=path, n_ctx=args.n_ctx, n_threads=threads,
                      n_threads_batch=threads_batch, n_batch=256, verbose=False)
                for _ in range(parallel)]
        for llm in llms:
            direct_one(llm, warm, 8)
        direct = run_load(lambda llm, p: direct_one(llm, p, args.tokens), llms, items, concurrency)
        del llms
        with edge_agent(home, "--parallel", str(parallel), "--threads", str(threads),
                        "--threads-batch", str(threads_batch), "--n-ctx", str(args.n_ctx),
                        "--max-waiting", "64") as url:
            for _ in range(parallel):
                agent_one(url, warm, 8)
            via = run_load(lambda u, p: agent_one(u, p, args.tokens), [url] * concurrency, items,
                           concurrency)
        rows.append((concurrency, f"{parallel} x {threads}/{threads_batch}", direct, via))

    print(f"\n{args.model} ({Path(path).name}), {args.requests} requests x {args.tokens} tokens, "
          f"greedy, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, {cores} cores\n")
    print(f"{'in flight':>9} {'slots x thr':>13} | {'direct tok/s':>12} {'agent tok/s':>11} "
          f"{'ratio':>6} | {'direct TTFT ms':>14} {'agent TTFT ms':>13} {'overhead ms':>11}")
    for concurrency, shape, d, a in rows:
        print(f"{concurrency:>9} {shape:>13} | {d['tok_s']:>12.1f} {a['tok_s']:>11.1f} "
              f"{a['tok_s'] / d['tok_s']:>6.3f} | {d['ttft_ms']:>14.1f} {a['ttft_ms']:>13.1f} "
              f"{a['ttft_ms'] - d['ttft_ms']:>11.1f}")
    print("\nslots x thr: agent slots (direct: llama-cpp-python contexts) x decode/prompt "
          "threads each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
