"""Prefill/decode interference: the decode TPOT of running streams while long prompts keep
arriving, co-located (`--both 1`, one worker with 2 threads) versus disaggregated (`--prefill 1
--decode 1`, one thread each), same run, same workload, through the gateway.

    .venv/bin/python bench/pd_interference.py [--streams 4] [--stream-tokens 128]
        [--long-tokens 2048] [--modes both,pd]

While ``--streams`` greedy streams decode ``--stream-tokens`` tokens each, one long prompt of
``--long-tokens`` tokens (unique, so no prefix hits) is in flight at all times. TPOT here is
each stream's gap between consecutive tokens, pooled over all streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from cascade.processes import free_port, spawn, stop, wait_healthy
from cascade_cli.spawn import cascade_command

# the figures here are about SmolLM2-135M (the defaults are the Qwen tier pair): every server started here serves it
os.environ.setdefault("CASCADE_EDGE_MODEL_NAME", "smollm2-135m")
os.environ.setdefault("CASCADE_CLOUD_ENGINE_MODEL", "smollm2-135m")

REPO = Path(__file__).resolve().parent.parent

MODES = {"both": ["--both", "1", "--prefill", "0", "--decode", "0", "--worker-threads", "2"],
         "pd": ["--prefill", "1", "--decode", "1", "--worker-threads", "1"]}
LABELS = {"both": "co-located (1 worker x 2 threads)",
          "pd": "disaggregated (1 prefill + 1 decode, 1 thread each)"}


def long_prompt(tokenizer, n_tokens: int, rng: random.Random) -> str:
    words = ["river", "mountain", "engine", "quantum", "garden", "ledger", "signal", "harbor",
             "copper", "lantern", "orbit", "meadow", "cipher", "glacier", "violet", "anchor",
             "prairie", "falcon"]
    text = f"Document {rng.randrange(10**9)}: "
    while len(tokenizer.encode(text)) < n_tokens:
        text += " ".join(rng.choice(words) for _ in range(200)) + ". "
    ids = tokenizer.encode(text)[:n_tokens]
    return tokenizer.decode(ids)


async def stream_tokens(client, url, headers, prompt: str, max_tokens: int) -> list[float]:
    """Token arrival times of one greedy stream."""
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and "error" not in chunk:
                    times.append(time.perf_counter())
    return times


async def long_prompts(client, url, headers, prompts: list[str],
                       done: asyncio.Event) -> list[float]:
    ttfts = []
    i = 0
    while not done.is_set():
        start = time.perf_counter()
        body = {"model": "smollm2-135m", "prompt": prompts[i % len(prompts)], "max_tokens": 4,
                "temperature": 0.5}
        r = await client.post(f"{url}/v1/completions", json=body, headers=headers)
        r.raise_for_status()
        ttfts.append(time.perf_counter() - start)
        i += 1
    return ttfts


async def workload(url: str, key: str, args, prompts: list[str]) -> dict:
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=600) as client:
        # warm both paths once
        await stream_tokens(client, url, headers, "Warm up.", 4)
        done = asyncio.Event()
        streams = [asyncio.create_task(stream_tokens(client, url, headers,
                                                     f"Story {i}: once upon a time",
                                                     args.stream_tokens))
                   for i in range(args.streams)]
        await asyncio.sleep(1.0)  # the streams are decoding
        longs = asyncio.create_task(long_prompts(client, url, headers, prompts, done))
        times = await asyncio.gather(*streams)
        done.set()
        long_e2e = await longs
    gaps = np.concatenate([np.diff(t) for t in times if len(t) > 1]) * 1e3
    return {"tpot_p50": float(np.percentile(gaps, 50)), "tpot_p99": float(np.percentile(gaps, 99)),
            "tpot_max": float(gaps.max()), "long_done": len(long_e2e),
            "long_e2e_s": float(np.mean(long_e2e)) if long_e2e else float("nan"),
            "tokens": int(sum(len(t) for t in times))}


def run_mode(mode: str, args, prompts, work: Path) -> dict:
    db = work / f"{mode}.db"
    env = {"CASCADE_CLOUD_GATEWAY_DB": str(db), "CASCADE_CLOUD_GATEWAY_TTFT_SLO_S": "600",
           "CASCADE_CLOUD_GATEWAY_PREFILL_MS_PER_TOKEN": "3"}
    out = subprocess.run(cascade_command("cloud", "keys", "create", "--db", str(db),
                                         "--tenant", "bench"),
                         env={**os.environ, "OMP_WAIT_POLICY": "passive", **env},
                         capture_output=True, text=True, check=True).stdout
    key = out.strip().splitlines()[-1]
    port = free_port()
    proc = spawn(cascade_command("cloud", "serve", "--port", str(port), "--max-model-len", "4096",
                                 *MODES[mode]), env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=600, what=f"{mode} gateway")
        return asyncio.run(workload(url, key, args, prompts))
    finally:
        stop(proc, timeout_s=60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--long-tokens", type=int, default=2048)
    p.add_argument("--modes", default="both,pd")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from serve_bench import load_tokenizer  # noqa: I001 (a sibling: sys.path[0] is bench/)

    tok = load_tokenizer("smollm2-135m")
    rng = random.Random(args.seed)
    prompts = [long_prompt(tok, args.long_tokens, rng) for _ in range(16)]
    work = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    results = {m: run_mode(m, args, prompts, work) for m in args.modes.split(",")}
    print(f"\nP/D interference: {args.streams} greedy streams x {args.stream_tokens} tokens while "
          f"{args.long_tokens}-token prompts keep arriving (one in flight), {os.cpu_count()} cores")
    print(f"{'mode':52s} {'TPOT p50':>9s} {'TPOT p99':>9s} {'max gap':>9s} {'long done':>10s} "
          f"{'long e2e':>9s}")
    for m, r in results.items():
        print(f"{LABELS[m]:52s} {r['tpot_p50']:7.1f}ms {r['tpot_p99']:7.1f}ms "
              f"{r['tpot_max']:7.0f}ms {r['long_done']:10d} {r['long_e2e_s']:8.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
