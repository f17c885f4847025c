"""The engine's Qwen2 (Llama with q/k/v biases, RoPE base 1e6, GQA) against transformers'
Qwen2ForCausalLM on a tiny random-weight model (tests/tiny_qwen2.py), tied and untied embeddings,
and the engine's KV paths on it: chunked prefill, prefix cache, int8 KV, swap preemption, the
second KV tier, a prefill/decode handoff. Each compares with transformers' own greedy run, so a
lost bias, a wrong RoPE base or a wrong query-to-KV-head mapping fails every one of them."""

from __future__ import annotations

import functools

import pytest
import torch

from cloud_tier.engine import LLMEngine, SamplingParams
from tests.handoff import hand_over
from tests.tiny_qwen2 import engine_greedy, hf_greedy, make_tiny_qwen2

NEW_TOKENS = 24
TEXTS = ["Hello, my name is", "def fibonacci(n):", "1, 2, 3, 4,", "The river wound through the valley, " * 6]
PROMPTS = [list(t.encode()) for t in TEXTS]  # byte-level tokens; the last (216) > the 64-token budget
FP32_LOGITS_ATOL = 2e-3  # as tests/integration/test_engine_parity.py (measured here: < 1e-5)
# bfloat16 against float32 (measured here: 0.034-0.046 on logits of magnitude ~4; without the
# q/k/v bias or with RoPE base 1e4 they differ by more than 1)
BF16_LOGITS_ATOL = 0.15
INT8_LOGITS_ATOL = 0.15  # int8 K/V against float32 (measured here: up to 0.05)
SMALL = dict(dtype="float32", max_model_len=512, block_size=16, threads=1)


@pytest.fixture(scope="module", params=["tied", "untied"])
def tiny(request, tmp_path_factory):
    """(model directory, transformers' float32 model of it)."""
    from transformers import Qwen2ForCausalLM

    path = make_tiny_qwen2(tmp_path_factory.mktemp(f"qwen2-{request.param}"), tie=request.param == "tied")
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == (request.param == "tied")
    return path, model


@functools.cache
def _reference(model, prompt: tuple[int, ...]):
    return hf_greedy(model, list(prompt), NEW_TOKENS)


def reference(tiny, prompts=PROMPTS):
    return [_reference(tiny[1], tuple(p)) for p in prompts]


@pytest.mark.parametrize("attention", ["native", "torch"])
def test_float32_tokens_and_logits_equal_transformers_with_chunked_prefill(tiny, attention):
    engine = LLMEngine.from_model(str(tiny[0]), num_kv_blocks=64, max_num_batched_tokens=64, **SMALL)
    assert engine.model.layers[0].self_attn.qkv_proj.bias is not None
    if attention == "torch":
        engine.runner.native_attention = None
    for i, ((tokens, logits), (expected, expected_logits)) in enumerate(
            zip(engine_greedy(engine, PROMPTS, NEW_TOKENS), reference(tiny), strict=True)):
        assert tokens == expected, f"prompt {i}"
        assert len(logits) == len(expected_logits)
        for step, (mine, theirs) in enumerate(zip(logits, expected_logits, strict=True)):
            diff = (mine - theirs).abs().max().item()
            assert diff < FP32_LOGITS_ATOL, f"prompt {i} step {step}: logits differ by {diff}"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_bfloat16_first_tokens_and_logits_are_near_transformers_float32(tiny):
    """bfloat16 against the float32 reference, held as tests/integration/test_engine_parity.py
    holds SmolLM2's bfloat16: every prompt's first token equal and the first step's logits close."""
    engine = LLMEngine.from_model(str(tiny[0]), num_kv_blocks=64, max_num_batched_tokens=64,
                                  **{**SMALL, "dtype": "bfloat16"})
    for i, ((tokens, logits), (expected, expected_logits)) in enumerate(
            zip(engine_greedy(engine, PROMPTS, 4), reference(tiny), strict=True)):
        assert tokens[0] == expected[0], f"prompt {i}"
        diff = (logits[0] - expected_logits[0]).abs().max().item()
        assert diff < BF16_LOGITS_ATOL, f"prompt {i}: first-step logits differ by {diff}"


def shared_prefix_prompts(n: int = 5) -> list[list[int]]:
    """``n`` prompts on one 96-token (6-block) prefix, each with its own question."""
    prefix = list((b"You are a careful assistant for a parcel depot. " * 3)[:96])
    return [prefix + list(f" Question {k}: where is parcel {k * 7}?".encode()) for k in range(n)]


def _one_by_one(engine, prompts) -> list:
    """Each prompt run alone, in turn (a later one finds the earlier ones' blocks cached)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    return [engine.generate([p], params)[0] for p in prompts]


def test_prefix_cache_hits_give_transformers_tokens(tiny):
    prompts = shared_prefix_prompts(3)
    engine = LLMEngine.from_model(str(tiny[0]), num_kv_blocks=64, **SMALL)
    outs = _one_by_one(engine, prompts)
    assert [o.token_ids for o in outs] == [t for t, _ in reference(tiny, prompts)]
    assert outs[0].num_cached_tokens == 0 and all(o.num_cached_tokens == 96 for o in outs[1:])


def test_int8_kv_cache_stays_near_transformers(tiny):
    """Quantized K/V: every prompt's first token equal to the float32 reference, and the logits of
    every step up to the first token that differs within INT8_LOGITS_ATOL of it (a near-tie may
    flip a token, and all after it, on another CPU)."""
    engine = LLMEngine.from_model(str(tiny[0]), num_kv_blocks=64, max_num_batched_tokens=64,
                                  kv_cache_dtype="int8", **SMALL)
    ours, expected = engine_greedy(engine, PROMPTS, NEW_TOKENS), reference(tiny)
    for i, ((tokens, logits), (ref_tokens, ref_logits)) in enumerate(zip(ours, expected, strict=True)):
        assert tokens[0] == ref_tokens[0], f"prompt {i}"
        same = next((k for k, (a, b) in enumerate(zip(tokens, ref_tokens, strict=False)) if a != b), len(tokens))
        for step in range(same):
            diff = (logits[step] - ref_logits[step]).abs().max().item()
            assert diff < INT8_LOGITS_ATOL, f"prompt {i} step {step}: logits differ by {diff}"


def test_swap_preemption_gives_transformers_tokens(tiny):
    """Eight requests in 10 blocks: some are swapped out to host memory and back."""
    prompts = [list(f"Write a list of {n} fruits:".encode()) for n in range(3, 11)]
    engine = LLMEngine.from_model(str(tiny[0]), num_kv_blocks=10, max_num_batched_tokens=128,
                                  preemption_mode="swap", **{**SMALL, "max_model_len": 128})
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert [o.token_ids for o in outs] == [t for t, _ in reference(tiny, prompts)]
    st = engine.stats()
    assert st["preemptions_by_swap"] > 0 and st["preemptions_by_recompute"] == 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_second_kv_tier_serves_evicted_prefixes_with_transformers_tokens(tiny, tmp_path):
    """Five prompts on five 6-block prefixes in 12 blocks, then the first two again: their
    prefixes come back from the tier."""
    systems = [list((f"Policy book {n}: parcels for region {n} leave the depot at {n + 6}. " * 3)[:96].encode())
               for n in range(5)]
    prompts = [s + list(b" Question: where is parcel 17?") for s in systems]
    prompts += [s + list(b" Question: when does it open?") for s in systems[:2]]
    small = {**SMALL, "max_model_len": 192}
    per_block = LLMEngine.from_model(str(tiny[0]), num_kv_blocks=12, **small).scheduler.swap.bytes_per_block
    engine = LLMEngine.from_model(str(tiny[0]), num_kv_blocks=12, kv_tier_path=str(tmp_path),
                                  kv_tier_bytes=64 * per_block, **small)
    outs = _one_by_one(engine, prompts)
    assert [o.token_ids for o in outs] == [t for t, _ in reference(tiny, prompts)]
    assert engine.stats()["kv_tier_hits"] >= 2 * 6 and outs[-1].num_cached_tokens == 96


def test_prefill_decode_handoff_gives_transformers_tokens(tiny):
    """Prefill on one engine, the KV exported and adopted by another, decoded there."""
    prefill = LLMEngine.from_model(str(tiny[0]), num_kv_blocks=64, max_num_batched_tokens=64, **SMALL)
    decode = LLMEngine.from_model(str(tiny[0]), num_kv_blocks=64, **SMALL)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    for prompt, (expected, _) in zip(PROMPTS, reference(tiny), strict=True):
        _, final = hand_over(prefill, decode, prefill.make_request(prompt, params), check_integrity=True)
        assert final.token_ids == expected
    assert decode.kv.num_free_blocks == decode.kv.num_blocks
    assert prefill.kv.num_free_blocks == prefill.kv.num_blocks
