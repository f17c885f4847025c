"""Preemption by swap versus recompute: one batch of prompts in a KV cache too small for it, run
once per ``preemption_mode``; wall time, preemptions of each kind, bytes swapped, and the two
costs the "auto" mode weighs (copy seconds per block, prefill seconds per block of tokens).

    .venv/bin/python bench/preemption.py [--prompts 8] [--max-tokens 64] [--kv-blocks 14]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# before torch loads (lazily, in main): its OpenMP threads read this once
os.environ.setdefault("OMP_WAIT_POLICY", "passive")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-blocks", type=int, default=14)
    args = ap.parse_args()

    from cloud_tier.engine import LLMEngine, SamplingParams

    prompts = [f"Write a list of {n} fruits, each with its colour and the country it grows in:"
               for n in range(3, 3 + args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"\n{args.model} float32: {args.prompts} prompts x {args.max_tokens} tokens in {args.kv_blocks} KV blocks\n")
    print(f"{'mode':<10} {'wall s':>7} {'by swap':>8} {'by recompute':>13} {'swapped MiB':>12} "
          f"{'copy ms/block':>14} {'prefill ms/block':>17}")
    outputs = {}
    for mode in ("recompute", "swap", "auto"):
        engine = LLMEngine.from_model(args.model, dtype="float32", max_model_len=224, num_kv_blocks=args.kv_blocks,
                                      block_size=16, max_num_batched_tokens=128, preemption_mode=mode)
        start = time.perf_counter()
        outputs[mode] = [o.token_ids for o in engine.generate(prompts, params)]
        wall = time.perf_counter() - start
        st, swap = engine.stats(), engine.scheduler.swap
        copy = f"{swap.copy_s_per_byte * swap.bytes_per_block * 1000:.2f}" if swap.copy_s_per_byte else "-"
        prefill = f"{swap.prefill_s_per_token * 16 * 1000:.2f}" if swap.prefill_s_per_token else "-"
        print(f"{mode:<10} {wall:>7.1f} {st['preemptions_by_swap']:>8} {st['preemptions_by_recompute']:>13} "
              f"{st['preemptions_swapped_out_bytes'] / 2**20:>12.1f} {copy:>14} {prefill:>17}")
    same = outputs["swap"] == outputs["recompute"] == outputs["auto"]
    print(f"\ngreedy outputs identical across modes: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
