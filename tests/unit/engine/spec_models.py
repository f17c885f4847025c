"""Tiny random-weight models for the speculative decoding tests: the Qwen2 of tests/tiny_qwen2.py
and a Llama of the same size with the same byte-level tokenizer, each an HF directory the engine
loads; and the engine's plain greedy answers to compare with."""

from __future__ import annotations

from pathlib import Path

import torch

from cloud_tier.engine import LLMEngine, SamplingParams
from tests.tiny_qwen2 import VOCAB, _byte_tokenizer, make_tiny_qwen2

SMALL = dict(dtype="float32", max_model_len=512, block_size=4, threads=1, num_kv_blocks=256)


def make_tiny_llama(out_dir: Path, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=256, eos_token_id=257,
                         pad_token_id=256, initializer_range=0.15, dtype="float32")
    model = LlamaForCausalLM(config).eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    _byte_tokenizer().save_pretrained(out_dir)
    return out_dir


def make_tiny(kind: str, out_dir: Path) -> Path:
    return make_tiny_qwen2(out_dir, tie=True) if kind == "qwen2" else make_tiny_llama(out_dir)


def run(engine: LLMEngine, requests) -> list:
    """Step ``requests`` (made by ``engine.make_request``) to their ends, the KV cache's invariants
    checked after every step; their final outputs in order."""
    for r in requests:
        engine.add(r)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_integrity()
    return [final[r.request_id] for r in requests]


def plain_greedy(engine: LLMEngine, prompt: list[int], max_tokens: int, **params) -> list[int]:
    """The engine's non-speculative greedy answer (its prefix cache reset after)."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    out = run(engine, [engine.make_request(prompt, sp)])[0]
    engine.kv.reset_prefix_cache()
    return out.token_ids
