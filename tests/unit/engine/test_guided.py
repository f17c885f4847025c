"""Guided decoding in the engine (issue 41): a request with ``SamplingParams.guided`` (an llguidance
grammar, here built from a JSON Schema by ``cascade.structured``) answers within its grammar, greedy or
sampled, under preemption and across a prefill/decode handoff; the other rows of its batch are
untouched; a grammar that cannot be compiled is refused with its request alone."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from cascade.structured.contract import contract_of
from cascade.structured.grammar import grammar_of
from cascade.structured.matcher import GrammarRefused
from cloud_tier.engine import LLMEngine, SamplingParams
from cloud_tier.engine.draft import Draft
from cloud_tier.engine.request import Request
from cloud_tier.engine.sampler import Sampler
from cloud_tier.sampling import MAX_GUIDED_BYTES
from tests.handoff import hand_over
from tests.tiny_qwen2 import VOCAB, make_tiny_qwen2

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 3},
        "born": {"type": "string", "format": "date"},
        "pet": {"type": "object", "properties": {"kind": {"type": "string", "maxLength": 10},
                                                 "age": {"type": "integer", "minimum": 0, "maximum": 30}},
                "required": ["kind", "age"], "additionalProperties": False},
    },
    "required": ["name", "color", "tags", "born", "pet"],
    "additionalProperties": False,
    "$defs": {"tag": {"type": "string", "maxLength": 8}},
}
PROMPT = "Describe a person and their pet as JSON."
UNGUIDED = ["Once upon a time", "The capital of France is"]


def grammar(schema: dict = SCHEMA) -> str:
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
    return grammar_of(contract_of(SimpleNamespace(model_extra=body)))


def assert_meets(text: str, schema: dict = SCHEMA) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def assert_idle(engine: LLMEngine) -> None:
    engine.check_integrity()
    st = engine.stats()
    assert st["running"] == st["waiting"] == 0 and not engine.scheduler.held
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


@pytest.fixture(scope="module")
def mixed(smollm2_engine):
    """One batch: a greedy and a sampled guided request beside a greedy and a sampled unguided one;
    then each unguided one alone."""
    guided = grammar()
    plain = [SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=1.0, seed=7, max_tokens=24)]
    params = [SamplingParams(temperature=0.0, max_tokens=160, guided=guided),
              SamplingParams(temperature=1.0, seed=3, max_tokens=160, guided=guided), *plain]
    outs = smollm2_engine.generate([PROMPT, PROMPT, *UNGUIDED], params)
    alone = [smollm2_engine.generate([p], sp)[0] for p, sp in zip(UNGUIDED, plain, strict=True)]
    return outs, alone


def test_a_greedy_guided_answer_meets_its_schema(mixed, smollm2_engine):
    out = mixed[0][0]
    assert out.finish_reason == "stop" and out.error is None
    assert_meets(out.text)
    assert out.token_ids[-1] not in smollm2_engine.eos_token_ids  # the grammar ended: no EOS needed
    assert smollm2_engine.stats()["guided_requests"] >= 2


def test_a_sampled_guided_answer_meets_its_schema(mixed):
    out = mixed[0][1]
    assert out.finish_reason == "stop"
    assert_meets(out.text)


def test_unguided_requests_beside_guided_ones_give_their_tokens_alone(mixed, smollm2_engine):
    outs, alone = mixed
    assert [o.token_ids for o in outs[2:]] == [o.token_ids for o in alone]
    assert_idle(smollm2_engine)


def test_a_grammar_that_cannot_compile_refuses_its_request_alone(smollm2_engine):
    engine = smollm2_engine
    ok = engine.add_request("Hello", SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(GrammarRefused):
        engine.add_request("Hello", SamplingParams(max_tokens=4, guided="start: missing_rule"))
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    assert list(final) == [ok] and final[ok].finish_reason == "length"
    assert_idle(engine)
    assert engine.stats()["guided_refused"] >= 1


def test_a_guided_request_under_preemption_meets_its_schema(smollm2_engine):
    """Four requests in 8 blocks: some are preempted (recomputed) and keep their matchers."""
    small = LLMEngine.from_model("smollm2-135m", dtype="float32", max_model_len=128, num_kv_blocks=8,
                                 block_size=16, max_num_batched_tokens=128)
    guided = SamplingParams(temperature=0.0, max_tokens=100, guided=grammar())
    reqs = [small.make_request(p, sp) for p, sp in zip([PROMPT, "Once upon a time, " * 3, PROMPT, "Hello " * 10],
                                                       [guided, SamplingParams(temperature=0.0, max_tokens=60)] * 2,
                                                       strict=True)]
    final = {}
    for r in reqs:
        small.add(r)
    while small.has_unfinished_requests():
        final.update((o.request_id, o) for o in small.step() if o.finished)
    assert reqs[0].num_preemptions + reqs[2].num_preemptions > 0
    for r in (reqs[0], reqs[2]):
        assert final[r.request_id].finish_reason == "stop"
        assert_meets(final[r.request_id].text)
    assert_idle(small)


def test_guided_params_travel_in_the_record_and_are_bounded():
    p = SamplingParams(guided="start: /[a-z]+/")
    assert SamplingParams.from_dict(p.to_dict()) == p and p.to_dict()["guided"] == "start: /[a-z]+/"
    with pytest.raises(ValueError, match="guided"):
        SamplingParams(guided="x" * (MAX_GUIDED_BYTES + 1))
    with pytest.raises(ValueError, match="guided"):
        SamplingParams(guided="")


# -- a tiny random-weight Qwen2: a byte-level tokenizer of 258 tokens in 272 logits rows ------------

SMALL = dict(dtype="float32", max_model_len=256, block_size=16, threads=1)
TINY_SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                "ok": {"type": "boolean"},
                                                "kind": {"enum": ["a", "bb", "ccc"]}},
               "required": ["id", "ok", "kind"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_qwen2(tmp_path_factory.mktemp("qwen2-guided"), tie=True))


def test_the_mask_allows_no_padding_row_and_eos_only_where_the_grammar_ends(tiny):
    engine = LLMEngine.from_model(tiny, num_kv_blocks=32, **SMALL)
    req = engine.make_request([1, 2, 3], SamplingParams(temperature=0.0, guided=grammar(TINY_SCHEMA)))
    allowed = req.guide.allowed()
    assert len(allowed) == VOCAB and not allowed[258:].any()  # rows past the tokenizer's 258
    assert allowed[ord("{")] and not allowed[257]  # <|im_end|>, the engine's EOS, not before the JSON
    for t in b'{"id": 7, "ok": true, "kind": "a"}':
        assert req.guide.accept(t)
    assert req.guide.done or req.guide.allowed()[257]


def test_a_sampler_masks_only_guided_rows_and_reports_the_raw_logprobs():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[0, ord("x")] = logits[2, ord("x")] = 50.0  # both rows' favourite, which the grammar forbids
    guide = _FixedGuide(allowed={ord("{")})
    reqs = [Request("g", [1], SamplingParams(temperature=0.0, logprobs=1)),
            Request("u", [1], SamplingParams(temperature=1.0, seed=4)),
            Request("v", [1], SamplingParams(temperature=0.0))]
    reqs[0].guide = guide
    out = Sampler()(logits.clone(), reqs)
    alone = Sampler()(logits[1:].clone(), reqs[1:])
    assert out.token_ids == [ord("{"), *alone.token_ids] and out.token_ids[2] == ord("x")
    assert guide.accepted == [ord("{")] and not out.errors
    assert out.logprobs[0].top[0][0] == ord("x")  # the model's own distribution, before the mask


def test_a_matcher_that_fails_ends_its_row_alone():
    refusing, broken, raising = (_FixedGuide(allowed={ord("{")}) for _ in range(3))
    refusing.accept = lambda token: False  # the grammar took the token back: should not happen
    broken.bitmask_into = lambda row: 1 / 0
    raising.accept = lambda token: 1 / 0
    reqs = [Request(r, [1], SamplingParams(temperature=0.0)) for r in "abcd"]
    reqs[0].guide, reqs[1].guide, reqs[2].guide = refusing, broken, raising
    out = Sampler()(torch.zeros(4, VOCAB), reqs)
    assert sorted(out.errors) == [0, 1, 2] and "refused the sampled token" in out.errors[0]
    assert "ZeroDivisionError" in out.errors[1] and "ZeroDivisionError" in out.errors[2]


def test_a_guided_request_takes_no_draft_and_no_ngram_proposal(tiny):
    engine = LLMEngine.from_model(tiny, num_kv_blocks=32, speculative="ngram", **SMALL)
    params = SamplingParams(temperature=0.0, max_tokens=40, guided=grammar(TINY_SCHEMA))
    req = engine.make_request([1, 2, 3], params, draft=Draft.of(list(b'{"id": 1')))
    assert req.spec.skipped == "guided" and not req.spec.token_ids
    engine.add(req)
    while engine.has_unfinished_requests():
        engine.step()
    st = engine.stats()
    assert st["spec_drafts_refused"] == 1 and st["spec_ngram_tokens_proposed"] == 0
    assert_meets(engine.tokenizer.decode(req.output_token_ids), TINY_SCHEMA)


class _FixedGuide:
    """A matcher that allows a fixed set of tokens (the sampler's view of one)."""

    def __init__(self, allowed: set[int]):
        self.allowed_ids, self.accepted, self.failed, self.done, self.error = allowed, [], False, False, "refused"

    def bitmask_into(self, row) -> None:
        for t in self.allowed_ids:
            row[t // 32] |= 1 << (t % 32)

    def accept(self, token: int) -> bool:
        self.accepted.append(token)
        return token in self.allowed_ids


def test_a_guided_request_handed_over_continues_its_grammar_on_the_decode_engine(tiny):
    prefill = LLMEngine.from_model(tiny, num_kv_blocks=32, **SMALL)
    decode = LLMEngine.from_model(tiny, num_kv_blocks=32, **SMALL)
    params = SamplingParams(temperature=0.0, max_tokens=80, guided=grammar(TINY_SCHEMA))
    req = prefill.make_request(list(b"Answer: "), params)
    first, final = hand_over(prefill, decode, req)
    assert first.token_ids == req.output_token_ids == [ord("{")]  # the prefill worker sampled under the mask
    assert final.finish_reason == "stop"
    assert_meets(final.text, TINY_SCHEMA)
    assert_idle(decode)
