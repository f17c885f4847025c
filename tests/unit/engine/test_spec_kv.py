"""The KV of rejected proposals is dropped: the request's counter goes back to its accepted length,
its blocks past it are freed, and no block holding a rejected position is ever registered in the
prefix cache; the answers stay exact under the prefix cache, chunked prefill, preemption (swap and
recompute), and a prefill/decode handoff (where the draft is refused: the handoff carries one token)."""

from __future__ import annotations

import dataclasses

import pytest

from cloud_tier.engine import LLMEngine, SamplingParams
from cloud_tier.engine.draft import Draft
from tests.handoff import hand_over
from tests.unit.engine.spec_models import SMALL, make_tiny, plain_greedy, run

PROMPT = list(b"def fibonacci(n):")  # 17 tokens: blocks of 4 end mid-draft
N = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=N)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny("qwen2", tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def plain(path):
    return LLMEngine.from_model(str(path), **SMALL)


def answer(plain, prompt):
    return plain_greedy(plain, prompt, N)


def test_after_a_rejection_blocks_past_the_accepted_tokens_are_freed_and_none_is_cached(path, plain):
    base = answer(plain, PROMPT)
    engine = LLMEngine.from_model(str(path), **SMALL)
    draft = [*base[:5], (base[5] + 1) % 256, *base[6:12]]  # 17 + 12 positions: 8 blocks; 5 accepted
    req = engine.make_request(PROMPT, GREEDY, draft=Draft.of(draft))
    engine.add(req)
    engine.step()
    assert req.output_token_ids == base[:6] and req.num_computed_tokens == 17 + 5
    blocks = engine.kv.req_blocks[req.request_id]
    assert len(blocks) == engine.kv.blocks_for_tokens(req.num_tokens)  # 23 tokens: 6 blocks, not 8
    bs = engine.kv.block_size
    cached = {b.block_id: b.token_ids for b in engine.kv.pool.cached.values()}
    # only blocks full of known tokens computed by now: positions < 17 (the prompt, 4 blocks)
    assert cached == {blocks[i].block_id: tuple(req.token_ids[i * bs:(i + 1) * bs]) for i in range(17 // bs)}
    engine.check_integrity()
    run(engine, [])
    while engine.has_unfinished_requests():
        engine.step()
    assert req.output_token_ids == base


def test_a_second_request_over_a_verified_prefix_reads_the_right_kv(path, plain):
    """B's prompt is A's prompt and answer: it hits A's blocks, some of which held A's rejected
    proposals before they were overwritten by the accepted tokens' KV."""
    base = answer(plain, PROMPT)
    engine = LLMEngine.from_model(str(path), **SMALL)
    a_draft = [*base[:3], (base[3] + 1) % 256, *base[4:10]]
    (a,) = run(engine, [engine.make_request(PROMPT, GREEDY, draft=Draft.of(a_draft))])
    assert a.token_ids == base and a.draft_accepted == 3
    follow = [*PROMPT, *base]
    (b,) = run(engine, [engine.make_request(follow, GREEDY)])
    assert b.num_cached_tokens >= 36
    uncached = LLMEngine.from_model(str(path), **{**SMALL, "enable_prefix_caching": False})
    assert b.token_ids == plain_greedy(uncached, follow, N)


def test_a_prompt_and_draft_longer_than_a_steps_budget_verify_what_fits_the_last_chunk(path, plain):
    prompt = list(b"The river wound through the valley, and on.")  # 43 tokens
    base = answer(plain, prompt)
    engine = LLMEngine.from_model(str(path), **{**SMALL, "max_num_batched_tokens": 16})
    (out,) = run(engine, [engine.make_request(prompt, GREEDY, draft=Draft.of(base[:12]))])
    assert out.token_ids == base
    assert out.draft_accepted == 5  # chunks of 16, 16, then 11 of prompt + 5 of the draft


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_with_drafts_give_the_plain_answers(path, plain, mode):
    prompts = [PROMPT, list(b"1, 2, 3, 4,"), list(b"Hello, my name is"), list(b"import numpy as")]
    bases = [answer(plain, p) for p in prompts]
    drafts = [bases[0][:8], [(bases[1][0] + 1) % 256, *bases[1][1:6]], bases[2][:3] + [0] * 4, bases[3][:16]]
    tight = {**SMALL, "num_kv_blocks": 20, "max_model_len": 64, "preemption_mode": mode}
    engine = LLMEngine.from_model(str(path), **tight)
    reqs = [engine.make_request(p, GREEDY, draft=Draft.of(d)) for p, d in zip(prompts, drafts, strict=True)]
    outs = run(engine, reqs)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == bases
    assert dataclasses.asdict(engine.scheduler.swap.stats)[f"by_{mode}"] > 0


def test_a_prefill_for_a_handoff_refuses_its_draft_and_the_decode_side_finishes_exactly(path, plain):
    base = answer(plain, PROMPT)
    prefill = LLMEngine.from_model(str(path), **SMALL)
    decode = LLMEngine.from_model(str(path), **SMALL)
    first, final = hand_over(prefill, decode, prefill.make_request(PROMPT, GREEDY, draft=Draft.of(base[:8])),
                             check_integrity=True)
    assert first.token_ids == base[:1] and first.finish_reason == "transfer"
    assert (first.draft_offered, first.draft_accepted, first.draft_skipped) == (8, 0, "kv_transfer")
    assert final.token_ids == base
    assert prefill.speculation.counts.drafts_refused == 1
