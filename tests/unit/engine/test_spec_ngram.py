"""Prompt-lookup speculation (``EngineConfig.speculative = "ngram"``): the proposer's matches, and
the engine's greedy answers equal to the plain engine's, token for token, with many proposed tokens
accepted; rows with and without proposals in one step; sampled requests through the same rule."""

from __future__ import annotations

import pytest

from cloud_tier.engine import EngineConfig, LLMEngine, SamplingParams
from cloud_tier.engine.spec.ngram import propose_ngram
from tests.unit.engine.spec_models import SMALL, make_tiny, run


@pytest.mark.parametrize(("tokens", "k", "expected"), [
    ([1, 2, 3, 4, 1, 2, 3], 3, [4, 1, 2]),  # the 3-gram [1, 2, 3] matched at 0
    ([1, 2, 3, 9, 2, 3, 7, 2, 3], 2, [7, 2]),  # the latest earlier match of [2, 3] (at 4), not the first
    ([5, 6, 7, 8], 4, []),  # nothing repeats
    ([4, 4, 4, 4], 2, [4]),  # [4, 4, 4] at 0: only one token follows it before the suffix
    ([1, 2, 1], 5, [2, 1]),  # 1-gram
])
def test_proposals_follow_the_latest_earlier_match_of_the_longest_suffix(tokens, k, expected):
    assert propose_ngram(tokens, k, 1, 3) == expected


def test_engine_config_refuses_an_unknown_method_and_bad_sizes():
    for bad in ({"speculative": "eagle"}, {"num_speculative_tokens": 0}, {"ngram_min": 3, "ngram_max": 2}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def engines(request, tmp_path_factory):
    """(plain engine, ngram engine, the kind). The tiny Qwen2's greedy answers fall into loops that
    prompt lookup predicts; the tiny Llama's wander and seldom repeat (few proposals accepted)."""
    path = make_tiny(request.param, tmp_path_factory.mktemp(request.param))
    return (LLMEngine.from_model(str(path), **SMALL),
            LLMEngine.from_model(str(path), speculative="ngram", num_speculative_tokens=4, **SMALL), request.param)


COPY = list(b"x = [a, b, c]\ny = [a, b, c]\nz = [a, b, c]\nw = [a, b")  # copy-heavy: a list repeated


def test_ngram_greedy_answers_equal_the_plain_engines_with_many_tokens_accepted(engines):
    plain, spec, kind = engines
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    prompts = [COPY, list(b"def fibonacci(n):"), list(b"1, 2, 3, 4,")]
    expected = [o.token_ids for o in run(plain, [plain.make_request(p, sp) for p in prompts])]
    got = [o.token_ids for o in run(spec, [spec.make_request(p, sp) for p in prompts])]
    assert got == expected
    c = spec.speculation.counts
    assert c.ngram_tokens_proposed > c.ngram_tokens_accepted
    if kind == "qwen2":
        assert c.ngram_tokens_accepted >= 40, c


def test_rows_with_and_without_proposals_share_steps(engines):
    plain, spec, kind = engines
    sp = SamplingParams(temperature=0.0, max_tokens=32)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)  # never speculates
    mixed = []
    execute = spec.runner.execute

    def watching(batch):
        rows = [bool(s.spec_token_ids) for s in batch.scheduled if s.samples]
        if len(set(rows)) == 2:
            mixed.append(rows)
        return execute(batch)

    spec.runner.execute = watching
    try:
        reqs = [spec.make_request(COPY, sp), spec.make_request(COPY, with_logprobs),
                spec.make_request(list(b"Hello, my name is"), sp)]
        got = run(spec, reqs)
    finally:
        spec.runner.execute = execute
    expected = run(plain, [plain.make_request(COPY, sp), plain.make_request(COPY, with_logprobs),
                           plain.make_request(list(b"Hello, my name is"), sp)])
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [lp.token_id for lp in got[1].logprobs] == expected[1].token_ids
    assert mixed  # some step verified proposals beside plain decodes
    assert reqs[1].spec.proposed == 0 and reqs[0].spec.proposed + reqs[2].spec.proposed > 0


def test_sampled_requests_speculate_and_keep_their_seeded_lengths(engines):
    _, spec, _ = engines
    sp = SamplingParams(temperature=0.7, top_k=5, max_tokens=40, seed=3)
    before = spec.speculation.counts.ngram_steps
    (out,) = run(spec, [spec.make_request(COPY, sp)])
    assert len(out.token_ids) == 40 or out.finish_reason == "stop"
    assert spec.speculation.counts.ngram_steps > before


def test_the_worker_config_turns_ngram_on_by_its_engine_section():
    from cloud_tier.config import CloudConfig

    config = CloudConfig.load(environ={"CASCADE_CLOUD_ENGINE_SPECULATIVE": "ngram",
                                       "CASCADE_CLOUD_ENGINE_NUM_SPECULATIVE_TOKENS": "6"})
    assert (config.engine.speculative, config.engine.num_speculative_tokens) == ("ngram", 6)
    assert CloudConfig.load(environ={}).engine.speculative == ""  # off by default
