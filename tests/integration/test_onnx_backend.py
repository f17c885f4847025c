"""The ONNX Runtime backend on real SmolLM2 exports: the backend contract, prefix reuse, the
fp32 export's greedy tokens against our PyTorch engine's, the int4 export's agreement with it,
and provider fallback."""

import logging

import pytest

from cloud_tier.engine import SamplingParams
from edge_agent.backends import onnx
from edge_agent.backends.base import GenerationOptions
from edge_agent.backends.onnx import OnnxBackend, OnnxConfig
from edge_agent.hardware import ProviderChoice
from tests.integration.backend_contract import BackendContract, run, text_of

PARITY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis is the process by which",
]
PARITY_TOKENS = 24
# The int4 export (MatMulNBits, int8 activations) against the float32 engine, teacher-forced:
# measured 0.65 top-1 and 0.95 top-5 here; the bounds leave room for other CPUs' kernels.
INT4_MIN_TOP1, INT4_MIN_TOP5 = 0.5, 0.85


def loaded(path, **kwargs) -> OnnxBackend:
    b = OnnxBackend(OnnxConfig(path=str(path), name="smollm2-135m", **{"n_ctx": 512, **kwargs}))
    b.load()
    return b


@pytest.fixture(scope="module")
def backend(onnx_export):
    b = loaded(onnx_export("int4"))
    yield b
    b.unload()


@pytest.fixture(scope="module")
def engine_tokens(smollm2_engine):
    """The PyTorch engine's greedy tokens (float32) for PARITY_PROMPTS."""
    outs = smollm2_engine.generate([smollm2_engine.tokenizer.encode(p) for p in PARITY_PROMPTS],
                                   SamplingParams(temperature=0.0, max_tokens=PARITY_TOKENS))
    return [o.token_ids for o in outs]


def onnx_greedy(b, prompts, n):
    return [[t.token_id for t in run(b, b.tokenize(p), GenerationOptions(max_tokens=n, temperature=0))[0]]
            for p in prompts]


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class TestOnnxBackend(BackendContract):
    def test_a_shared_prefix_is_not_evaluated_again(self, backend):
        base = "You are a helpful assistant. " * 8
        run(backend, base + "What is 2+2?")
        _, finish = run(backend, base + "What is 3+3?")
        assert finish.cached_tokens >= len(backend.tokenize(base)) - 2

    def test_reused_prefix_gives_the_same_greedy_output(self, backend):
        prompt = "Paris is the capital of"
        run(backend, "unrelated words first")  # resets the cache
        first, f1 = run(backend, prompt)
        again, f2 = run(backend, prompt)  # all but the last prompt token reused
        assert f1.cached_tokens == 0
        assert f2.cached_tokens == f2.prompt_tokens - 1
        assert [t.token_id for t in first] == [t.token_id for t in again]
        assert [t.logprob for t in first] == pytest.approx([t.logprob for t in again], abs=1e-4)

    def test_slots_share_one_model_and_keep_their_own_context(self, backend):
        other = loaded(backend.config.path)
        try:
            assert other._model is backend._model  # one og.Model per process
            alone, _ = run(backend, "Paris is the capital of")
            run(other, "Bananas are yellow because")
            again, finish = run(backend, "Paris is the capital of")
            assert finish.cached_tokens == finish.prompt_tokens - 1  # the other slot left it alone
            assert [t.token_id for t in again] == [t.token_id for t in alone]
        finally:
            other.unload()

    def test_a_full_context_ends_with_length(self, backend):
        small = loaded(backend.config.path, n_ctx=48)  # its own generator on the shared model
        try:
            prompt = small.tokenize(", ".join(str(i) for i in range(1, 40)))[:40]
            tokens, finish = run(small, prompt, GenerationOptions(max_tokens=100, temperature=0))
            assert finish.finish_reason == "length"
            assert finish.prompt_tokens + finish.completion_tokens == small.n_ctx
        finally:
            small.unload()

    def test_end_of_turn_ends_with_stop(self, backend):
        prompt = backend.apply_chat_template([{"role": "user", "content": "Say hello."}])
        tokens, finish = run(backend, backend.chat_prompt_tokens(prompt),
                             GenerationOptions(max_tokens=200, temperature=0))
        assert finish.finish_reason == "stop" and len(tokens) < 200
        assert "<|im_end|>" not in text_of(tokens, finish)

    def test_pieces_are_bytes_so_characters_split_across_tokens_stream_whole(self, backend):
        text = "naïve café 日本語 🙂"
        ids = backend.tokenize(text, add_special=False)
        pieces = [backend.detokenize([t]) for t in ids]
        assert any("\ufffd" in p for p in pieces)  # some token holds part of a character
        assert backend.detokenize(ids) == text

    def test_sampling_options_are_reproducible_with_a_seed(self, backend):
        opts = GenerationOptions(max_tokens=16, temperature=0.9, top_k=40, top_p=0.9, min_p=0.02,
                                 repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2, seed=7)
        a, _ = run(backend, "Once upon a time", opts)
        b, _ = run(backend, "Once upon a time", opts)
        assert [t.token_id for t in a] == [t.token_id for t in b]
        greedy, _ = run(backend, "Once upon a time", GenerationOptions(max_tokens=16, temperature=0))
        top1, _ = run(backend, "Once upon a time", GenerationOptions(max_tokens=16, temperature=1.0, top_k=1))
        assert [t.token_id for t in top1] == [t.token_id for t in greedy]


@pytest.fixture(scope="module")
def fp32_backend(onnx_export):
    b = loaded(onnx_export("fp32"))
    yield b
    b.unload()


def test_fp32_export_greedy_tokens_equal_the_engine(fp32_backend, engine_tokens):
    assert onnx_greedy(fp32_backend, PARITY_PROMPTS, PARITY_TOKENS) == engine_tokens


def test_a_prompt_appended_in_chunks_gives_the_same_tokens(fp32_backend):
    # fp32: its logits barely depend on how a prompt is split (int4's do, see onnx.py)
    chunked = loaded(fp32_backend.config.path, prompt_chunk=4)
    try:
        prompt = "The history of the printing press begins in the fifteenth century, when"
        assert len(chunked.tokenize(prompt)) > 2 * 4
        opts = GenerationOptions(max_tokens=12, temperature=0)
        whole, _ = run(fp32_backend, prompt, opts)
        split, _ = run(chunked, prompt, opts)
        assert [t.token_id for t in split] == [t.token_id for t in whole]
        assert [t.logprob for t in split] == pytest.approx([t.logprob for t in whole], abs=1e-3)
    finally:
        chunked.unload()


def test_int4_export_stays_close_to_the_engine(backend, engine_tokens):
    """int4 re-quantizes weights that were Q4_1 already, so its greedy text leaves the float32
    engine's early (first divergence measured here: [0, 0, 9, 0] of 24). The stated bound is on
    the next-token agreement along the engine's own continuation (teacher-forced), measured at
    65% top-1 and 95% top-5."""
    ours = onnx_greedy(backend, PARITY_PROMPTS, PARITY_TOKENS)
    divergence = [first_divergence(a, r) for a, r in zip(ours, engine_tokens, strict=True)]
    top1 = top5 = 0
    for prompt, ref in zip(PARITY_PROMPTS, engine_tokens, strict=True):
        ids = backend.tokenize(prompt)
        for i, expected in enumerate(ref):
            tokens, _ = run(backend, ids + ref[:i], GenerationOptions(max_tokens=1, temperature=0, top_logprobs=5))
            alternatives = [t.token_id for t in tokens[0].top] if tokens else []
            top1 += alternatives[:1] == [expected]
            top5 += expected in alternatives
    n = len(PARITY_PROMPTS) * PARITY_TOKENS
    logging.getLogger(__name__).info("int4 vs engine: first divergence %s, top-1 %.2f, top-5 %.2f",
                                     divergence, top1 / n, top5 / n)
    assert top1 / n >= INT4_MIN_TOP1 and top5 / n >= INT4_MIN_TOP5, (divergence, top1 / n, top5 / n)


def test_an_unavailable_provider_falls_back_to_cpu_with_a_warning(backend, caplog):
    with caplog.at_level(logging.WARNING, logger="edge_agent.backends.onnx"):
        b = loaded(backend.config.path, providers=("cuda", "cpu"))
    try:
        assert b.provider == "cpu"
        assert any(r.levelno == logging.WARNING and "cuda" in r.getMessage() for r in caplog.records)
        _, finish = run(b, "Hello")
        assert finish.finish_reason in ("stop", "length") and finish.completion_tokens > 0
    finally:
        b.unload()


def test_a_provider_that_fails_to_load_falls_back_to_cpu_with_a_warning(backend, caplog, monkeypatch):
    # the choice says cuda loads (as on a machine whose probe passed); og.Model then fails for real
    monkeypatch.setattr(onnx, "choose_providers", lambda requested: ProviderChoice(["cuda", "cpu"], "test"))
    with caplog.at_level(logging.INFO, logger="edge_agent.backends.onnx"):
        b = loaded(backend.config.path, providers=("cuda",))
    try:
        assert b.provider == "cpu"
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("cuda failed to load" in m for m in warned), warned
        assert any(m.startswith("onnx: provider cpu (") for m in (r.getMessage() for r in caplog.records))
        _, finish = run(b, "Hello")
        assert finish.completion_tokens > 0
    finally:
        b.unload()
