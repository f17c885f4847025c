from pathlib import Path

import pytest

from edge_agent.backends.base import GenerationOptions
from edge_agent.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
from model_distribution.artifacts.quantize import quantize
from tests.integration.backend_contract import BackendContract, run


@pytest.fixture(scope="module")
def backend(smollm2_path):
    b = LlamaCppBackend(LlamaCppConfig(path=smollm2_path, name="smollm2-135m", n_ctx=512), "Q4_1")
    b.load()
    yield b
    b.unload()


class TestLlamaCppBackend(BackendContract):
    def test_a_shared_prefix_is_not_evaluated_again(self, backend):
        base = "You are a helpful assistant. " * 8
        run(backend, base + "What is 2+2?")
        _, finish = run(backend, base + "What is 3+3?")
        chunk = backend.config.chunk
        assert finish.cached_tokens >= len(backend.tokenize(base)) // chunk * chunk > 0

    def test_reused_prefix_gives_the_same_greedy_output(self, backend):
        prompt = "Paris is the capital of France, and Berlin is the capital of Germany. " * 3
        fresh_tokens, _ = run(backend, "unrelated words first")  # resets the cache
        first, f1 = run(backend, prompt)
        again, f2 = run(backend, prompt)  # reused up to the last whole prompt chunk
        assert f1.cached_tokens == 0
        assert f2.cached_tokens == (f2.prompt_tokens - 1) // backend.config.chunk * backend.config.chunk > 0
        assert [t.token_id for t in first] == [t.token_id for t in again]


@pytest.fixture(scope="module")
def k_quant_backend(smollm2_path, tmp_path_factory):
    """SmolLM2 in Q4_K_M: llama.cpp's repacked K-quant kernels compute a few rows differently
    from many, so a prompt evaluated in other pieces gives other logits (Q4_1 does the same on
    other CPUs)."""
    path = quantize(Path(smollm2_path), tmp_path_factory.mktemp("q4k") / "smollm2-q4_k_m.gguf", "q4_k_m")
    b = LlamaCppBackend(LlamaCppConfig(path=str(path), name="smollm2-q4_k_m", n_ctx=512), "Q4_K_M")
    b.load()
    yield b
    b.unload()


@pytest.mark.parametrize("options", [GenerationOptions(max_tokens=8, temperature=0.0),
                                     GenerationOptions(max_tokens=8, temperature=1.0, seed=7)],
                         ids=["greedy", "seeded"])
def test_cache_state_changes_neither_seeded_text_nor_logprobs(k_quant_backend, options):
    """Issue 37 item 13: cold, fully cached and partly cached (by 3, 5 and 40 tokens) give the same
    tokens and logprobs."""
    b = k_quant_backend
    prompt = b.tokenize("The history of the city goes back many centuries, with markets, rivers and "
                        "old stone bridges. " * 6 + "Tell me about it.")

    def answer():
        tokens, _ = run(b, prompt, options)
        return [t.token_id for t in tokens], [t.logprob for t in tokens]

    run(b, "Unrelated.", GenerationOptions(max_tokens=1, temperature=0))
    cold = answer()
    paths = {"fully cached": answer()}
    for k in (3, 5, 40):
        run(b, prompt[:-k] + [0], GenerationOptions(max_tokens=1, temperature=0))
        paths[f"cached but {k}"] = answer()
    for name, (ids, logprobs) in paths.items():
        assert ids == cold[0], name
        assert logprobs == pytest.approx(cold[1], abs=1e-4), name
