"""What the cascade's confidence hold-back costs: time to first token of an edge agent in
`auto` mode (the first K tokens held back and judged before any is released) against the same
agent in `local` mode (no hold-back), same prompts, same run. The thresholds are set so that
nothing escalates: only the hold-back is measured.

    .venv/bin/python bench/cascade_ttft.py [--hold 4,8,16] [--requests 12]

The agent needs an upstream for auto mode to judge anything; a port with nothing listening is
enough, since nothing goes up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from cascade.processes import free_port, spawn, stop, wait_healthy
from cascade_cli.spawn import cascade_command

# the figures here are about SmolLM2-135M (the defaults are the Qwen tier pair): every server started here serves it
os.environ.setdefault("CASCADE_EDGE_MODEL_NAME", "smollm2-135m")
os.environ.setdefault("CASCADE_CLOUD_ENGINE_MODEL", "smollm2-135m")

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["Which city is the capital of France?", "Write a haiku about the sea.",
           "Name three primary colors.", "What is 12 + 30?", "Say hello to the factory floor.",
           "List two uses of a paperclip."]


def ttft(url: str, prompt: str, mode: str) -> float:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 32, "temperature": 0, "stream": True, "cascade": {"mode": mode}}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                    return (time.perf_counter() - start) * 1e3
    return float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hold", default="4,8,16")
    p.add_argument("--requests", type=int, default=12)
    args = p.parse_args()
    rows = []
    for k in [int(x) for x in args.hold.split(",")]:
        port = free_port()
        env = {"CASCADE_EDGE_UPSTREAM_URL": f"http://127.0.0.1:{free_port()}",
               "CASCADE_EDGE_CASCADE_HOLD_TOKENS": str(k),
               "CASCADE_EDGE_CASCADE_MIN_MEAN_LOGPROB": "-1000"}
        proc = spawn(cascade_command("edge", "run", "--port", str(port)), env=env, cwd=REPO)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, timeout_s=120, what="edge agent")
            ttft(url, "Warm up.", "local")
            local, auto = [], []
            for i in range(args.requests):
                prompt = PROMPTS[i % len(PROMPTS)]
                local.append(ttft(url, prompt, "local"))
                auto.append(ttft(url, prompt, "auto"))
            rows.append((k, statistics.median(local), statistics.median(auto)))
        finally:
            stop(proc, timeout_s=30)
    print(f"\nEdge TTFT with the confidence hold-back (SmolLM2-135M Q4_1, llama.cpp, "
          f"{os.cpu_count()} cores, {args.requests} requests each, median)")
    print(f"{'K':>3} {'local TTFT ms':>14} {'auto TTFT ms':>13} {'hold-back ms':>13}")
    for k, lo, au in rows:
        print(f"{k:>3} {lo:14.1f} {au:13.1f} {au - lo:13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
