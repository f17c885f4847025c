"""What the INT8 KV cache costs in quality: the same model on a float cache and on an int8 one,
compared by greedy agreement on the engine parity prompts and by perplexity on ShareGPT text.

    .venv/bin/python bench/kv_int8_quality.py [--dtype float32] [--texts 32] [--new-tokens 64]

Greedy agreement: per prompt, the share of the generated positions before the first token that
differs (a near-tie that flips one token changes everything after it). Perplexity: each text
teacher-forced as one prefill whose attention reads K/V back from the cache (so through the int8
rows and scales), every position's next-token loss.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

# before torch loads (lazily, in main): its OpenMP threads read this once
os.environ.setdefault("OMP_WAIT_POLICY", "passive")


# tests/integration/test_engine_parity.py's prompts (the ones held to HF transformers); the layers
# contract keeps benchmarks from importing the tests
PARAGRAPH = ("The river wound through the valley, past farms and mills, carrying boats of grain "
             "towards the sea, where merchants waited on the docks for news of the harvest. ")
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a land far away,", "1, 2, 3, 4,", PARAGRAPH * 6 + "In summary,",
           "What is 2+2? The answer is", "Water boils at"]


def sharegpt_texts(tokenizer, n: int, max_tokens: int) -> list[list[int]]:
    """Token ids of the first ``n`` ShareGPT exchanges (prompt and reply) of 64+ tokens, cut at
    ``max_tokens``."""
    from cascade.eval.sharegpt import first_exchange, load_conversations

    texts = []
    for conv in load_conversations(limit=20 * n):
        pair = first_exchange(conv)
        if pair is None:
            continue
        ids = tokenizer.encode(pair[0] + "\n\n" + pair[1])[:max_tokens]
        if len(ids) >= 64:
            texts.append(ids)
        if len(texts) == n:
            break
    return texts


def sequence_nll(engine, ids: list[int]) -> float:
    """Summed next-token negative log-likelihood of ``ids``, as one prefill into blocks 0.. of an
    idle engine (prefix caching off, so no cached block is overwritten)."""
    import torch
    import torch.nn.functional as F

    from cloud_tier.engine.attention import AttentionMetadata

    runner = engine.runner
    blocks = list(range(-(-len(ids) // runner.block_size)))
    meta = AttentionMetadata.build([(0, len(ids), blocks)], runner.block_size, runner.windows, runner.device,
                                   runner.native_attention)
    tokens = torch.tensor(ids, device=runner.device)
    with torch.inference_mode():
        hidden = engine.model(tokens, torch.arange(len(ids), device=runner.device), runner.kv_caches, meta)
        logits = engine.model.compute_logits(hidden[:-1]).float()
    return F.cross_entropy(logits, tokens[1:], reduction="sum").item()


def decode_kernel_us(engine, batch: int = 16, context: int = 1024, repeats: int = 20) -> float | None:
    """Microseconds of one layer's decode attention (the compiled kernel) over this engine's cache
    format: ``batch`` sequences of ``context`` tokens in shuffled blocks. None without the kernel."""
    import torch

    from cloud_tier.engine.kv_quant import Int8KV

    runner, native = engine.runner, engine.runner.native_attention
    if native is None:
        return None
    _, bs, n_kv, hd = runner.kv_block_shape()
    heads = engine.model.layers[0].self_attn.n_heads
    slots = batch * context
    k, v = torch.randn(slots, n_kv, hd), torch.randn(slots, n_kv, hd)
    tables = torch.randperm(slots // bs).view(batch, -1).contiguous()
    lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, heads, hd)
    if runner.kv_int8:
        kq, vq = Int8KV.zeros(k.shape, "cpu"), Int8KV.zeros(v.shape, "cpu")
        kq.write(torch.arange(slots), k)
        vq.write(torch.arange(slots), v)

        def step():
            native.paged_decode_int8(q, kq.data, kq.scale, vq.data, vq.scale, tables, lens, hd ** -0.5, -1, bs)
    else:
        k, v = k.to(runner.dtype), v.to(runner.dtype)

        def step():
            native.paged_decode(q, k, v, tables, lens, hd ** -0.5, -1, bs)
    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats * 1e6


def first_diff(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--texts", type=int, default=32, help="ShareGPT texts for the perplexity")
    ap.add_argument("--max-tokens", type=int, default=512, help="tokens per text, at most")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per parity prompt")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()

    from cloud_tier.engine import LLMEngine, SamplingParams

    results = {}
    for kv in ("auto", "int8"):
        start = time.perf_counter()
        engine = LLMEngine.from_model(args.model, dtype=args.dtype, kv_cache_dtype=kv, max_model_len=1024,
                                      num_kv_blocks=256, enable_prefix_caching=False, threads=args.threads)
        texts = sharegpt_texts(engine.tokenizer, args.texts, args.max_tokens)
        nll = sum(sequence_nll(engine, ids) for ids in texts)
        n = sum(len(ids) - 1 for ids in texts)
        outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True))
        results[kv] = (math.exp(nll / n), n, [o.token_ids for o in outs], time.perf_counter() - start,
                       decode_kernel_us(engine))
        del engine

    (ppl_f, n, toks_f, t_f, us_f), (ppl_q, _, toks_q, t_q, us_q) = results["auto"], results["int8"]
    agreement = [first_diff(q, f) / len(f) for q, f in zip(toks_q, toks_f, strict=True)]
    positions = sum(x == y for q, f in zip(toks_q, toks_f, strict=True) for x, y in zip(q, f, strict=True))
    print(f"{args.model} {args.dtype}: float KV vs int8 KV ({len(PROMPTS)} parity prompts x {args.new_tokens} "
          f"greedy tokens; perplexity over {n} ShareGPT tokens)")
    print(f"{'':34}{'float':>10}{'int8':>10}")
    print(f"{'perplexity':34}{ppl_f:>10.4f}{ppl_q:>10.4f}   delta {ppl_q - ppl_f:+.4f} "
          f"({100 * (ppl_q / ppl_f - 1):+.3f}%)")
    print(f"{'prompts identical to the end':34}{'':>10}{sum(a == 1 for a in agreement):>7}/{len(agreement)}")
    print(f"{'first tokens equal':34}{'':>10}{sum(q[0] == f[0] for q, f in zip(toks_q, toks_f, strict=True)):>7}"
          f"/{len(agreement)}")
    print(f"{'agreement before first diff':34}{'':>10}{sum(agreement) / len(agreement):>10.3f}   per prompt "
          + " ".join(f"{a:.2f}" for a in agreement))
    print(f"{'positions equal':34}{'':>10}{positions / sum(map(len, toks_f)):>10.3f}")
    if us_f is not None and us_q is not None:
        print(f"{'decode kernel, 16 x 1024 tok (us)':34}{us_f:>10.0f}{us_q:>10.0f}   one layer, x{us_f / us_q:.2f}")
    print(f"{'wall (s)':34}{t_f:>10.1f}{t_q:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
