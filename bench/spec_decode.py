"""Speculative decoding in our engine: (a) a device's draft verified in one pass, and (b) the
engine's own prompt-lookup (n-gram) proposals, each against plain decoding, in one process.

    .venv/bin/python bench/spec_decode.py [--model tiny|qwen2.5-coder-1.5b|...] [--weight-dtype int8]
        [--max-tokens 32] [--ks 4,8,16] [--draft-model qwen2.5-coder-0.5b] [--repeats 2]

(a) Time to the full answer (``--max-tokens``, greedy) of one request alone: without a draft, then
with a draft of K tokens that is the engine's own greedy answer's first K (all accepted: the best
case), then, with ``--draft-model``, with the K first tokens of that model's own greedy answer
(what a device would send; the acceptance is whatever it is). (b) The same prompts copy-heavy
("repeat/edit this code"), decoded plainly and with ``speculative = "ngram"`` (4 tokens per step).
The tiny model (random weights, built here) measures the machinery, not acceptance.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

from cloud_tier.engine import LLMEngine, SamplingParams
from cloud_tier.engine.draft import Draft

CODE = '''def moving_average(values, window):
    out = []
    for i in range(len(values) - window + 1):
        out.append(sum(values[i:i + window]) / window)
    return out
'''
QUESTION = "Explain in two sentences what a hash map is."
COPY_PROMPTS = [f"Repeat this code exactly, then stop:\n{CODE}\n",
                f"Rename `values` to `xs` in this code and print the whole result:\n{CODE}\n"]


def tiny_model(out: Path) -> Path:
    """A random-weight 2-layer Qwen2 with a byte-level tokenizer (ids 0-255 and two specials)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=256, eos_token_id=257, initializer_range=0.15)
    Qwen2ForCausalLM(config).save_pretrained(out)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>")
    fast.save_pretrained(out)
    return out


def prompt_ids(engine: LLMEngine, text: str) -> list[int]:
    tok = engine.tokenizer
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(text)


def timed(engine: LLMEngine, prompt: list[int], max_tokens: int, draft: list[int] | None = None):
    """(seconds to the full answer, its output) of one greedy request alone."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    req = engine.make_request(prompt, params, draft=Draft.of(draft) if draft else None)
    start = time.perf_counter()
    engine.add(req)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    engine.kv.reset_prefix_cache()  # every run computes its prompt
    return time.perf_counter() - start, final


def best(engine, prompt, max_tokens, repeats, draft=None):
    """The fastest of ``repeats`` runs (after one not counted: the first step of a shape is slower)."""
    timed(engine, prompt, max_tokens, draft)
    runs = [timed(engine, prompt, max_tokens, draft) for _ in range(repeats)]
    return min(s for s, _ in runs), runs[-1][1]


def device_draft(args) -> list[int] | None:
    """The ``--draft-model``'s own greedy answer to the question (its tokenizer is the served model's:
    the same prompt ids), its engine freed after: one model in memory at a time."""
    if not args.draft_model:
        return None
    small = LLMEngine.from_model(args.draft_model, dtype="float32", max_model_len=1024, num_kv_blocks=64,
                                 threads=args.threads)
    _, out = timed(small, prompt_ids(small, QUESTION), max(args.ks))
    del small
    gc.collect()
    return out.token_ids


def bench_drafts(engine, args, device: list[int] | None) -> list[tuple]:
    rows = []
    prompt = prompt_ids(engine, QUESTION)
    base_s, base = best(engine, prompt, args.max_tokens, args.repeats)
    rows.append(("no draft", 0, 0, base_s, 1.0))
    for k in args.ks:
        s, out = best(engine, prompt, args.max_tokens, args.repeats, base.token_ids[:k])
        assert out.token_ids == base.token_ids, "a draft changed the greedy answer"
        rows.append(("own answer", k, out.draft_accepted, s, base_s / s))
        if device is not None:
            s, out = best(engine, prompt, args.max_tokens, args.repeats, device[:k])
            assert out.token_ids == base.token_ids, "a draft changed the greedy answer"
            rows.append((args.draft_model, k, out.draft_accepted, s, base_s / s))
    return rows


def bench_ngram(engine, args) -> list[tuple]:
    """Plain, then ngram on the same engine (its proposer switched on: one model in memory)."""
    rows = []
    spec = engine.speculation
    for i, text in enumerate(COPY_PROMPTS):
        prompt = prompt_ids(engine, text)
        spec.method = ""
        p_s, p_out = best(engine, prompt, args.max_tokens, args.repeats)
        spec.method, spec.num_tokens = "ngram", 4
        before = dict(vars(spec.counts))
        s_s, s_out = best(engine, prompt, args.max_tokens, args.repeats)
        c, runs = spec.counts, args.repeats + 1
        proposed = (c.ngram_tokens_proposed - before["ngram_tokens_proposed"]) // runs
        accepted = (c.ngram_tokens_accepted - before["ngram_tokens_accepted"]) // runs
        assert s_out.token_ids == p_out.token_ids, "ngram speculation changed the greedy answer"
        rows.append((f"copy prompt {i}", len(prompt), proposed, accepted, p_s, s_s, p_s / s_s))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny (random weights, built here) or any engine model")
    ap.add_argument("--weight-dtype", default="auto", choices=["auto", "int8"])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ks", type=lambda s: [int(k) for k in s.split(",")], default=[4, 8, 16])
    ap.add_argument("--draft-model", default="", help="a smaller model whose greedy answer is the draft")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    model = str(tiny_model(Path(tempfile.mkdtemp()))) if args.model == "tiny" else args.model
    common = dict(dtype="float32", weight_dtype=args.weight_dtype, max_model_len=1024, num_kv_blocks=256,
                  threads=args.threads)
    device = device_draft(args)
    engine = LLMEngine.from_model(model, **common)
    name = Path(model).name if args.model == "tiny" else args.model
    print(f"\n(a) a draft verified in one pass: {name} (weights {args.weight_dtype}), {args.max_tokens} tokens, "
          f"best of {args.repeats}")
    print(f"{'draft':<22}{'K':>4}{'accepted':>10}{'answer s':>10}{'speed-up':>10}")
    for label, k, acc, s, up in bench_drafts(engine, args, device):
        print(f"{label:<22}{k:>4}{acc:>10}{s:>10.3f}{up:>9.2f}x")
    print(f"\n(b) ngram speculation (k=4, n 1-3) vs plain, copy-heavy prompts, {args.max_tokens} tokens")
    print(f"{'workload':<16}{'prompt':>7}{'proposed':>10}{'accepted':>10}{'plain s':>9}{'ngram s':>9}{'speed-up':>10}")
    for label, n, prop, acc, p_s, s_s, up in bench_ngram(engine, args):
        print(f"{label:<16}{n:>7}{prop:>10}{acc:>10}{p_s:>9.3f}{s_s:>9.3f}{up:>9.2f}x")


if __name__ == "__main__":
    main()
