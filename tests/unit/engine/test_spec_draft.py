"""A device's draft verified in one pass (greedy): the answer is exactly the non-speculative
greedy answer, token for token to max_tokens, whatever the draft: all right, wrong at its first
token, wrong in the middle, longer than max_tokens, a stop token inside; on a tiny Qwen2 and a tiny
Llama; and the accepted counts are exact (a verifier that accepts one token too many, or one too
few, fails here)."""

from __future__ import annotations

import pytest

from cloud_tier.engine import LLMEngine, SamplingParams
from cloud_tier.engine.draft import Draft
from tests.unit.engine.spec_models import SMALL, make_tiny, plain_greedy, run

PROMPT = list(b"def fibonacci(n):")
N = 24


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def engine(request, tmp_path_factory):
    path = make_tiny(request.param, tmp_path_factory.mktemp(request.param))
    return LLMEngine.from_model(str(path), **SMALL)


@pytest.fixture(scope="module")
def base(engine):
    return plain_greedy(engine, PROMPT, N)


def _wrong(token: int) -> int:
    return (token + 1) % 256


def with_draft(engine, draft, max_tokens=N, prompt=PROMPT, **params):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    return run(engine, [engine.make_request(prompt, sp, draft=Draft.of(draft))])[0]


@pytest.mark.parametrize("k", [1, 4, 8, 16])
def test_a_right_draft_is_accepted_whole_and_the_answer_is_unchanged(engine, base, k):
    out = with_draft(engine, base[:k])
    assert out.token_ids == base
    assert (out.draft_offered, out.draft_accepted, out.draft_skipped) == (k, k, "")


@pytest.mark.parametrize("wrong_at", [0, 1, 5, 7])
def test_a_draft_wrong_at_one_position_is_accepted_up_to_it(engine, base, wrong_at):
    draft = base[:8]
    draft[wrong_at] = _wrong(draft[wrong_at])
    out = with_draft(engine, draft)
    assert out.token_ids == base
    assert out.draft_accepted == wrong_at


def test_a_draft_longer_than_max_tokens_gives_max_tokens(engine, base):
    out = with_draft(engine, base, max_tokens=6)
    assert out.token_ids == base[:6] and out.finish_reason == "length"
    assert out.draft_accepted == 5  # the sixth token is the engine's own


def test_a_draft_of_the_whole_answer_ends_with_the_engines_last_token(engine, base):
    out = with_draft(engine, base)  # N tokens: at most N - 1 can be verified, the last is sampled
    assert out.token_ids == base and out.draft_accepted == N - 1


def test_a_stop_token_inside_a_right_draft_ends_the_answer_there(engine, base):
    stop = base[6]
    expected = plain_greedy(engine, PROMPT, N, stop_token_ids=(stop,))
    assert expected == base[:base.index(stop) + 1]
    out = with_draft(engine, base[:16], stop_token_ids=(stop,))
    assert out.token_ids == expected and out.finish_reason == "stop"
    assert out.draft_accepted == len(expected)  # the draft's tokens the answer keeps, not the 16 it agreed with


def test_a_stop_string_inside_a_right_draft_counts_only_what_the_answer_keeps(engine, base):
    text = engine.tokenizer.decode(base[:4])
    stop = text[-1]
    params = SamplingParams(temperature=0.0, max_tokens=N, stop=(stop,))
    expected = run(engine, [engine.make_request(PROMPT, params)])[0]
    out = with_draft(engine, base[:16], stop=(stop,))
    assert out.token_ids == expected.token_ids and out.finish_reason == "stop"
    assert out.draft_accepted <= len(out.token_ids) < 16


def test_eos_drafted_where_the_engine_goes_on_is_rejected(engine, base):
    eos = min(engine.eos_token_ids)
    assert eos not in base
    out = with_draft(engine, [*base[:3], eos, *base[4:8]])
    assert out.token_ids == base and out.draft_accepted == 3


def test_drafts_in_one_batch_with_plain_requests_each_get_their_own_answer(engine, base):
    sp = SamplingParams(temperature=0.0, max_tokens=N)
    other = list(b"1, 2, 3, 4,")
    expected_other = plain_greedy(engine, other, N)
    wrong = [*base[:2], _wrong(base[2]), *base[3:6]]
    reqs = [engine.make_request(PROMPT, sp, draft=Draft.of(base[:10])), engine.make_request(other, sp),
            engine.make_request(PROMPT, sp, draft=Draft.of(wrong)),
            engine.make_request(other, sp, draft=Draft.of(expected_other[:4]))]
    outs = run(engine, reqs)
    assert [o.token_ids for o in outs] == [base, expected_other, base, expected_other]
    assert [o.draft_accepted for o in outs] == [10, 0, 2, 4]
    engine.kv.reset_prefix_cache()


def test_a_malformed_draft_is_refused_when_the_request_is_made_and_nothing_is_queued(engine):
    from cloud_tier.engine.draft import DraftError

    with pytest.raises(DraftError, match=r"cascade\.draft\.token_ids\[1\]"):
        engine.make_request(PROMPT, SamplingParams(temperature=0.0), draft=Draft.of([1, 10**6]))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(("params", "why"), [({"logprobs": 1}, "logprobs"), ({"repetition_penalty": 1.2}, "penalties")])
def test_a_draft_for_a_request_it_cannot_serve_exactly_runs_without(engine, base, params, why):
    expected = plain_greedy(engine, PROMPT, N, **params)
    out = with_draft(engine, base[:8], **params)
    assert out.token_ids == expected
    assert (out.draft_offered, out.draft_accepted, out.draft_skipped) == (8, 0, why)
