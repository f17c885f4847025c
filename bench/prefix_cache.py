"""Prefix-cache effect on time to first token: a request whose 1,000-token system prompt is
already cached (hit) versus one whose system prompt is new (miss), same engine, same run.

    .venv/bin/python bench/prefix_cache.py [--prefix-tokens 1000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# before torch loads (lazily, in main): its OpenMP threads read this once
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

WORDS = ("shipment warehouse customs invoice pallet carrier route manifest depot schedule "
         "courier parcel freight container dock tracking delivery window policy section").split()


def system_prompt(tokenizer, n_tokens: int, variant: int) -> list[int]:
    words = [WORDS[(i * 7 + variant * 13) % len(WORDS)] for i in range(n_tokens * 2)]
    ids = tokenizer.encode(f"Policy book #{variant}: " + " ".join(words))
    return ids[:n_tokens]


def ttft(engine, prompt: list[int]) -> float:
    from cloud_tier.engine import SamplingParams

    start = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while True:
        for out in engine.step():
            if out.request_id == rid:
                return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from cloud_tier.engine import LLMEngine

    engine = LLMEngine.from_model(args.model, dtype=args.dtype, max_num_batched_tokens=2048)
    tok = engine.tokenizer
    question = tok.encode(" Question: where is parcel 17 now?", add_special_tokens=False)
    ttft(engine, system_prompt(tok, args.prefix_tokens, 999) + question)  # warm-up
    misses, hits = [], []
    for r in range(args.repeats):
        prefix = system_prompt(tok, args.prefix_tokens, r)
        misses.append(ttft(engine, prefix + question))  # first sight of this system prompt
        other = tok.encode(f" Question {r}: when does the depot open?", add_special_tokens=False)
        hits.append(ttft(engine, prefix + other))  # same system prompt, new question
    miss, hit = statistics.median(misses), statistics.median(hits)
    stats = engine.kv.stats
    print(f"\n{args.model} {args.dtype}: {args.prefix_tokens}-token shared system prompt, "
          f"{args.repeats} repeats\n")
    print(f"{'':<8} {'TTFT p50 ms':>12}")
    print(f"{'miss':<8} {miss * 1000:>12.1f}")
    print(f"{'hit':<8} {hit * 1000:>12.1f}")
    print(f"\nspeed-up {miss / hit:.1f}x; prefix cache hit rate over the run {stats.hit_rate:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
