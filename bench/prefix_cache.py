"""Prefix-cache effect on time to first token: a request whose 1,000-token system prompt is
already cached (hit) versus one whose system prompt is new (miss), same engine, same run.

With ``--kv-tier-bytes N``: a working set of ``--prefixes`` system prompts served round robin from
a KV cache of ``--kv-blocks`` blocks, too small to hold them all (LRU then keeps none of them),
without and with a second KV tier of N bytes: TTFT and the share of prompt tokens served from cache.

    .venv/bin/python bench/prefix_cache.py [--prefix-tokens 1000] [--repeats 5]
    .venv/bin/python bench/prefix_cache.py --kv-tier-bytes 2000000000 [--prefixes 4] [--kv-blocks 160]
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


def working_set(args) -> None:
    """Round robin over more system prompts than the cache holds, tier off then on."""
    from cloud_tier.engine import LLMEngine

    print(f"\n{args.model} {args.dtype}: {args.prefixes} system prompts of {args.prefix_tokens} tokens round "
          f"robin, {args.rounds} rounds, KV cache of {args.kv_blocks} blocks of 16\n")
    print(f"{'tier':<14} {'TTFT p50 ms (1st round)':>24} {'later rounds':>13} {'hit share':>10} {'tier hits':>10}")
    for tier_bytes in (0, args.kv_tier_bytes):
        engine = LLMEngine.from_model(args.model, dtype=args.dtype, max_num_batched_tokens=2048,
                                      num_kv_blocks=args.kv_blocks, kv_tier_bytes=tier_bytes)
        tok = engine.tokenizer
        prefixes = [system_prompt(tok, args.prefix_tokens, v) for v in range(args.prefixes)]
        ttft(engine, system_prompt(tok, args.prefix_tokens, 999))  # warm-up
        engine.kv.stats.queries = engine.kv.stats.hits = 0
        first, later = [], []
        for r in range(args.rounds):
            for prefix in prefixes:
                question = tok.encode(f" Question {r}: where is parcel 17 now?", add_special_tokens=False)
                (later if r else first).append(ttft(engine, prefix + question))
        st = engine.stats()
        name = f"{tier_bytes / 2**20:.0f} MiB" if tier_bytes else "off"
        print(f"{name:<14} {statistics.median(first) * 1000:>24.1f} {statistics.median(later) * 1000:>13.1f} "
              f"{engine.kv.stats.hit_rate:>10.0%} {st.get('kv_tier_hits', 0):>10}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-tier-bytes", type=int, default=0, help="compare a second KV tier of this size with none")
    ap.add_argument("--prefixes", type=int, default=4, help="system prompts in the working set (with a tier)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-blocks", type=int, default=160, help="KV cache blocks (with a tier): < the working set")
    args = ap.parse_args()
    if args.kv_tier_bytes:
        working_set(args)
        return 0

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
