import pytest

from edge_agent.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
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
        assert finish.cached_tokens >= len(backend.tokenize(base)) - 2

    def test_reused_prefix_gives_the_same_greedy_output(self, backend):
        prompt = "Paris is the capital of"
        fresh_tokens, _ = run(backend, "unrelated words first")  # resets the cache
        first, f1 = run(backend, prompt)
        again, f2 = run(backend, prompt)  # all but the last prompt token reused
        assert f2.cached_tokens == f2.prompt_tokens - 1
        assert [t.token_id for t in first] == [t.token_id for t in again]
