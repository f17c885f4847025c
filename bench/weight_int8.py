"""Weight-only INT8 (``weight_dtype="int8"``) against the engine dtype: decode step time at batch 1
and 8 beside the memory-bandwidth limit (the weight bytes a step reads / this machine's read
bandwidth, measured here as a large tensor sum), and with ``--quality`` the greedy agreement and the
perplexity on ShareGPT text (bench/kv_int8_quality.py's measures).

    .venv/bin/python bench/weight_int8.py [--model qwen2.5-coder-1.5b] [--dtype auto] [--threads 2] [--quality]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before torch loads: its OpenMP threads read it once


def read_bandwidth(repeats: int = 7) -> float:
    """Bytes per second this process reads: the median of sums over a 512 MiB float32 tensor."""
    import torch

    x = torch.ones(128 << 20)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times)


def decode_step_s(engine, batch: int, steps: int = 12) -> float:
    """Median seconds of one engine step with ``batch`` requests all decoding (short prompts)."""
    from cloud_tier.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"Request {i}: tell me about the history of printing.", params)
    for _ in range(3):  # the prefills, and a first decode
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def quality(engine, texts: list[list[int]], new_tokens: int) -> tuple[float, int, list[list[int]]]:
    """(perplexity over ``texts``, tokens scored, greedy tokens of the parity prompts)."""
    from bench.kv_int8_quality import PROMPTS, sequence_nll
    from cloud_tier.engine import SamplingParams

    nll = sum(sequence_nll(engine, ids) for ids in texts)
    n = sum(len(ids) - 1 for ids in texts)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    return math.exp(nll / n), n, [o.token_ids for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="auto", help="the engine dtype (auto: bfloat16 where native, else float32)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quality", action="store_true", help="also greedy agreement and ShareGPT perplexity")
    ap.add_argument("--texts", type=int, default=16, help="ShareGPT texts for the perplexity")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens per text, at most")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per parity prompt")
    args = ap.parse_args()

    import torch

    from bench.kv_int8_quality import first_diff, sharegpt_texts
    from cloud_tier.engine import LLMEngine
    from cloud_tier.engine.models.quantize import step_weight_bytes

    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    rows, results = [], {}
    for weights in ("auto", "int8"):
        engine = LLMEngine.from_model(args.model, dtype=args.dtype, weight_dtype=weights, max_model_len=1024,
                                      num_kv_blocks=256, enable_prefix_caching=False, threads=args.threads)
        name = engine.config.dtype if weights == "auto" else f"int8 ({engine.config.dtype} activations)"
        nbytes = step_weight_bytes(engine.model)
        for batch in (1, 8):
            rows.append((name, batch, decode_step_s(engine, batch), nbytes))
        if args.quality:
            texts = sharegpt_texts(engine.tokenizer, args.texts, args.max_tokens)
            results[weights] = quality(engine, texts, args.new_tokens)
        del engine

    print(f"{args.model}, {args.threads} threads; read bandwidth {bandwidth / 1e9:.1f} GB/s (a 512 MiB sum)")
    print(f"{'weights':32}{'batch':>6}{'step ms':>10}{'weight MB':>11}{'bound ms':>10}{'of bound':>10}")
    for name, batch, seconds, nbytes in rows:
        bound = nbytes / bandwidth
        print(f"{name:32}{batch:>6}{seconds * 1e3:>10.1f}{nbytes / 1e6:>11.0f}{bound * 1e3:>10.1f}"
              f"{bound / seconds:>10.0%}")
    if args.quality:
        (ppl_f, n, toks_f), (ppl_q, _, toks_q) = results["auto"], results["int8"]
        agree = [first_diff(q, f) / len(f) for q, f in zip(toks_q, toks_f, strict=True)]
        equal = sum(x == y for q, f in zip(toks_q, toks_f, strict=True) for x, y in zip(q, f, strict=True))
        print(f"perplexity over {n} ShareGPT tokens: {ppl_f:.4f} -> {ppl_q:.4f} ({100 * (ppl_q / ppl_f - 1):+.2f}%)")
        print(f"greedy ({len(toks_f)} prompts x {args.new_tokens}): positions equal "
              f"{equal / sum(map(len, toks_f)):.3f}, "
              f"agreement before the first difference {sum(agree) / len(agree):.3f}, "
              f"identical to the end {sum(a == 1 for a in agree)}/{len(agree)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
