"""Our engine against HF transformers (the numerical reference), both loading the same GGUF:
greedy tokens identical and per-step logits close, for a mixed continuous batch with chunked
prefill, and the KV cache's invariants checked after every step."""

import os

import pytest
import torch

from cascade.config import cascade_home
from cloud_tier.engine import LLMEngine
from model_distribution.artifacts.catalog import Catalog
from model_distribution.artifacts.model_dirs import resolve_model_dir
from tests.integration.gguf_reference import gguf_reference
from tests.tiny_qwen2 import engine_greedy

# every step's logits are compared, so drift shows without a long run: 32 steps cross two KV
# blocks of every prompt, and the decodes share steps with the long prompts' prefill chunks
NEW_TOKENS = 32
# scripts/gpu-check.sh runs these on CUDA (the reference stays on the CPU in float32)
DEVICE = os.environ.get("CASCADE_TEST_DEVICE", "cpu")
PARAGRAPH = ("The river wound through the valley, past farms and mills, carrying boats of grain "
             "towards the sea, where merchants waited on the docks for news of the harvest. ")
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4,",
    PARAGRAPH * 6 + "In summary,",  # ~170 tokens: prefilled in chunks of the 64-token budget
    "What is 2+2? The answer is",
    "Water boils at",
]


def run_engine_mixed(engine: LLMEngine, prompts: list[str], new_tokens: int = NEW_TOKENS):
    """Half the prompts first; the rest join after two steps, so prefill chunks and decodes
    share steps (``tests.tiny_qwen2.engine_greedy``). Returns {index: (token ids, [logits per step])}."""
    return dict(enumerate(engine_greedy(engine, prompts, new_tokens, join_after=2)))


def hf_reference(name: str):
    """transformers' own GGUF loader's model (shared with tests/integration/test_gguf_convert.py)."""
    catalog = Catalog(cascade_home())
    gguf = catalog.ensure_ready(catalog.get(name))
    return gguf_reference(gguf, resolve_model_dir(name)).model


_GENERATIONS: dict = {}


def reference_generations(name: str, prompts: tuple[str, ...], tokenizer, new_tokens: int = NEW_TOKENS) -> list:
    """transformers' greedy tokens and per-step logits for each prompt, computed once per model
    (both attention paths compare against the same run). Prompts of about the same length share
    one left-padded ``generate`` (one read of the weights per step for all of them: a step is
    memory-bound, ~1 GB of float32 weights for Gemma 3, and nine runs of one prompt cost a minute
    on the CI machine); each row is cut at its own end of sequence, as its own run would stop."""
    if (name, prompts, new_tokens) not in _GENERATIONS:
        ref = hf_reference(name)
        encoded = [tokenizer(p, return_tensors="pt").input_ids[0] for p in prompts]
        eos = ref.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        out: list = [None] * len(prompts)
        for group in _by_length(encoded, spread=32):
            width = max(len(encoded[i]) for i in group)
            ids = torch.full((len(group), width), pad, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for row, i in enumerate(group):
                ids[row, width - len(encoded[i]):] = encoded[i]
                mask[row, width - len(encoded[i]):] = 1
            with torch.inference_mode():
                gen = ref.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True, pad_token_id=pad)
            for row, i in enumerate(group):
                tokens = gen.sequences[row, width:].tolist()
                n = next((k + 1 for k, t in enumerate(tokens) if t in eos), len(tokens))
                out[i] = (tokens[:n], [step[row:row + 1] for step in gen.logits[:n]])
        _GENERATIONS[(name, prompts, new_tokens)] = out
    return _GENERATIONS[(name, prompts, new_tokens)]


def _by_length(encoded: list, spread: int) -> list[list[int]]:
    """Indices of ``encoded`` in groups whose lengths differ by at most ``spread`` tokens."""
    groups: list[list[int]] = []
    for i in sorted(range(len(encoded)), key=lambda i: len(encoded[i])):
        if groups and len(encoded[i]) - len(encoded[groups[-1][0]]) <= spread:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@pytest.mark.slow
@pytest.mark.parametrize("name, extra_prompt", [
    ("smollm2-135m", None),
    # > 512 tokens: Gemma's sliding-window layers must mask what their window excludes
    ("gemma3-270m", PARAGRAPH * 24 + "The merchants said"),
])
# "torch": the pure-torch decode attention (what CUDA, and a CPU without a compiler, run)
@pytest.mark.parametrize("attention", ["native", "torch"])
def test_greedy_tokens_and_logits_match_transformers(engine_home, name, extra_prompt, attention):
    prompts = PROMPTS + ([extra_prompt] if extra_prompt else [])
    engine = LLMEngine.from_model(name, dtype="float32", max_model_len=1024, max_num_batched_tokens=64,
                                  num_kv_blocks=400, device=DEVICE)
    if attention == "torch":
        engine.runner.native_attention = None
    elif engine.runner.native_attention is None and DEVICE == "cpu":
        pytest.skip("the native kernel could not be built here (no compiler)")
    ours = run_engine_mixed(engine, prompts)
    assert_equal_to_reference(ours, reference_generations(name, tuple(prompts), engine.tokenizer), name)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def assert_equal_to_reference(ours: dict, reference: list, name: str, atol: float = 2e-3) -> float:
    """Greedy tokens equal and every step's logits within ``atol``; returns the largest difference."""
    compared, largest = 0, 0.0
    for i, (expected, expected_logits) in enumerate(reference):
        tokens, logits = ours[i]
        assert tokens == expected, f"prompt {i} ({name}): first difference at {_first_diff(tokens, expected)}"
        for step, (mine, theirs) in enumerate(zip(logits, expected_logits, strict=False)):
            diff = (mine - theirs[0].float()).abs().max().item()
            assert diff < atol, f"prompt {i} step {step}: logits differ by {diff}"
            compared, largest = compared + 1, max(largest, diff)
        assert len(logits) == len(tokens)
    assert compared == sum(len(t) for t, _ in ours.values())
    return largest


def _first_diff(a, b):
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def greedy_agreement(ours: dict, reference: dict) -> list[float]:
    """Per prompt: the share of the generated positions before the first token that differs."""
    return [_first_diff(ours[i][0], reference[i][0]) / len(reference[i][0]) for i in reference]


@pytest.mark.slow
def test_smollm2_on_an_int8_kv_cache_agrees_with_the_float_cache(engine_home):
    """Greedy decoding over the int8 cache stays on the float cache's path: the same first token on
    every prompt, and on average most of the 32 positions before any difference. Measured on an
    AVX-512 EPYC: all 8 prompts identical for all 32 tokens, first-step logits within 0.13-0.51 of the
    float cache's; the bounds leave room for a near-tie that flips a token (and all after it)."""
    runs = {}
    for kv_cache_dtype in ("auto", "int8"):
        engine = LLMEngine.from_model("smollm2-135m", dtype="float32", kv_cache_dtype=kv_cache_dtype,
                                      max_model_len=1024, max_num_batched_tokens=64, num_kv_blocks=400, threads=1)
        runs[kv_cache_dtype] = run_engine_mixed(engine, PROMPTS)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        del engine
    floats, int8 = runs["auto"], runs["int8"]
    assert [t[0] for t, _ in int8.values()] == [t[0] for t, _ in floats.values()]
    agreement = greedy_agreement(int8, floats)
    assert sum(agreement) / len(agreement) >= 0.6, agreement
    for i in floats:  # the first token's logits (prefill over the quantized cache) stay close
        diff = (int8[i][1][0] - floats[i][1][0]).abs().max().item()
        assert diff < 1.5, f"prompt {i}: first-step logits differ by {diff}"


def _torch_only(engine: LLMEngine) -> None:
    """The engine's CPU kernels and packed weights off: every op on torch's own code."""
    from cloud_tier.engine.models import layers

    engine.runner.native_attention = None
    engine.runner.sampler.native = None
    layers.use_native(None)
    for m in engine.model.modules():
        if isinstance(m, layers.Linear):
            m.packed = None
    engine.model.packed_head = None


@pytest.mark.slow
def test_smollm2_in_bfloat16_on_the_kernels_agrees_with_torchs_own_ops(engine_home):
    """bfloat16 with the compiled kernels and oneDNN-packed weights against the same engine on
    torch's ops alone: no reference in transformers to be equal to (its bf16 differs from float32
    by more), so the two paths are held to each other: the first token of every prompt, most of
    the 32 positions, and the first step's logits within a few bfloat16 steps of the logit scale.
    Measured on an AMX Xeon: first-step logits identical on 6 of 8 prompts (0.17 and 0.34 apart on
    the others), 6 of 8 prompts identical for all 32 tokens, mean agreement 0.85; the bounds leave
    room for near-ties that flip a token (and all after it) on another CPU."""
    from cloud_tier.engine.models import layers

    runs = {}
    for path in ("kernels", "torch"):
        engine = LLMEngine.from_model("smollm2-135m", dtype="bfloat16", max_model_len=1024,
                                      max_num_batched_tokens=64, num_kv_blocks=400)
        if path == "kernels" and engine.runner.native_attention is None:
            pytest.skip("the native kernels could not be built here (no compiler)")
        saved = layers._native.get("ext")
        if path == "torch":
            _torch_only(engine)
        try:
            runs[path] = run_engine_mixed(engine, PROMPTS)
        finally:
            layers.use_native(saved)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        del engine
    kernels, plain = runs["kernels"], runs["torch"]
    assert [t[0] for t, _ in kernels.values()] == [t[0] for t, _ in plain.values()]
    agreement = greedy_agreement(kernels, plain)
    diffs = [(kernels[i][1][0] - plain[i][1][0]).abs().max().item() for i in plain]
    print(f"bf16 kernels vs torch: agreement {agreement}, first-step logit diffs {diffs}")
    assert sum(agreement) / len(agreement) >= 0.6, agreement
    for i, diff in enumerate(diffs):
        assert diff < 1.0, f"prompt {i}: first-step logits differ by {diff}"
