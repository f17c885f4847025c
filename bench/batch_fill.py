"""Batch fill: what a large Batch API job costs online traffic, and what it gets done when the
online load ebbs. An online load of bursts (``--burst`` concurrent greedy streams for
``--burst-s``) and troughs (one stream for ``--trough-s``), ``--cycles`` times, first alone, then
with a batch of ``--batch-lines`` requests submitted just before; same gateway (`cascade cloud
serve --both 1`), same run.

    .venv/bin/python bench/batch_fill.py [--cycles 3] [--burst 6] [--burst-s 8] [--trough-s 8]
        [--batch-lines 400] [--max-tokens 32] [--online-busy N] [--home DIR]

Online TTFT and TPOT (p50/p99) are measured by the client, over the streams of each run; batch
tokens are the batch tenant's completion tokens (the gateway's /metrics), counted per phase.
The batch is cancelled at the end (its unstarted lines never run).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

from cascade.processes import free_port, spawn, stop, wait_healthy
from cascade_cli.spawn import cascade_command

# the figures here are about SmolLM2-135M (the defaults are the Qwen tier pair): every server started here serves it
os.environ.setdefault("CASCADE_EDGE_MODEL_NAME", "smollm2-135m")
os.environ.setdefault("CASCADE_CLOUD_ENGINE_MODEL", "smollm2-135m")

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"


async def stream(client: httpx.AsyncClient, url: str, key: str, i: str, max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, gaps between tokens) of one greedy stream (a prompt of its own: never a result cache hit)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Story {i}: tell me about a river."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    times = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers={"authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    times.append(time.perf_counter())
    return (times[0] - start if times else float("nan")), list(np.diff(times))


async def phase(client, url, key, width: int, seconds: float, max_tokens: int, counter: list[int]) -> list:
    """``width`` streams kept in flight for ``seconds``: their (TTFT, gaps)."""
    end = time.monotonic() + seconds
    out = []

    async def lane():
        while time.monotonic() < end:
            counter[0] += 1
            out.append(await stream(client, url, key, f"{counter[0]}-{end:.0f}", max_tokens))

    await asyncio.gather(*(lane() for _ in range(width)))
    return out


def batch_tokens(url: str, tenant: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "cascade_gateway_completion_tokens_total" and s.labels.get("tenant") == tenant)


async def online_load(url: str, key: str, args, batch_tenant: str) -> dict:
    results, per_phase, counter = [], [], [0]
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(args.cycles):
            for name, width, seconds in (("burst", args.burst, args.burst_s), ("trough", 1, args.trough_s)):
                before = batch_tokens(url, batch_tenant)
                results += await phase(client, url, key, width, seconds, args.max_tokens, counter)
                per_phase.append((name, batch_tokens(url, batch_tenant) - before))
    ttft = np.array([t for t, _ in results]) * 1e3
    gaps = np.array([g for _, gs in results for g in gs]) * 1e3
    return {"requests": len(results), "ttft": np.percentile(ttft, [50, 99]), "tpot": np.percentile(gaps, [50, 99]),
            "phases": per_phase}


def submit_batch(url: str, key: str, lines: int, max_tokens: int) -> tuple[openai.OpenAI, str]:
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    body = "\n".join(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": MODEL, "messages": [{"role": "user", "content": f"Summarise item {i} of the catalogue."}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}) for i in range(lines))
    f = c.files.create(file=("batch.jsonl", io.BytesIO(body.encode())), purpose="batch")
    return c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--burst", type=int, default=6)
    p.add_argument("--burst-s", type=float, default=8.0)
    p.add_argument("--trough-s", type=float, default=8.0)
    p.add_argument("--batch-lines", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--online-busy", type=int, default=0,
                   help="[gateway] batch_online_busy: no batch line starts with this many online requests in flight")
    p.add_argument("--home", help="CASCADE_HOME (one that has the model converted saves minutes); default: a new one")
    args = p.parse_args()
    work = Path(args.home or tempfile.mkdtemp(prefix="batch-fill-"))
    env = {"CASCADE_HOME": str(work), "CASCADE_CLOUD_GATEWAY_TTFT_SLO_S": "600", "OMP_WAIT_POLICY": "passive",
           "CASCADE_CLOUD_GATEWAY_BATCH_ONLINE_BUSY": str(args.online_busy)}
    keys = {t: subprocess.run(cascade_command("cloud", "keys", "create", "--tenant", t), env={**os.environ, **env},
                              capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            for t in ("online", "batchjob")}
    port = free_port()
    proc = spawn(cascade_command("cloud", "serve", "--port", str(port), "--both", "1", "--prefill", "0",
                                 "--decode", "0", "--max-model-len", "1024"), env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=600, what="gateway")
        alone = asyncio.run(online_load(url, keys["online"], args, "batchjob"))
        c, batch_id = submit_batch(url, keys["batchjob"], args.batch_lines, args.max_tokens)
        with_batch = asyncio.run(online_load(url, keys["online"], args, "batchjob"))
        done = c.batches.retrieve(batch_id).request_counts.completed
        c.batches.cancel(batch_id)
        while c.batches.retrieve(batch_id).status != "cancelled":
            time.sleep(0.5)
    finally:
        stop(proc, timeout_s=60)
    print(f"\nBatch fill: bursts of {args.burst} streams ({args.burst_s:.0f} s) and troughs of 1 "
          f"({args.trough_s:.0f} s) x {args.cycles}, {args.max_tokens} tokens each, batch_online_busy "
          f"{args.online_busy}, {os.cpu_count()} cores")
    print(f"{'online load':24s} {'requests':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'TPOT p50':>9s} {'TPOT p99':>9s}")
    for name, r in (("alone", alone), (f"with a {args.batch_lines}-line batch", with_batch)):
        print(f"{name:24s} {r['requests']:8d} {r['ttft'][0]:7.0f}ms {r['ttft'][1]:7.0f}ms "
              f"{r['tpot'][0]:7.1f}ms {r['tpot'][1]:7.1f}ms")
    print("batch completion tokens per phase: " + ", ".join(f"{n} {t:.0f}" for n, t in with_batch["phases"]))
    print(f"batch lines completed during the run: {done} of {args.batch_lines}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
