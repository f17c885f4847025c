"""The contract every edge backend keeps (see edge_agent/backends/base.py).

A backend's test module subclasses ``BackendContract`` and provides a ``backend`` fixture
(loaded, n_ctx >= 512, a chat model). The ONNX Runtime backend will run this same suite.
"""

from __future__ import annotations

import math
import threading

import pytest

from edge_agent.backends.base import Finish, GenerationOptions, TokenEvent

GREEDY = GenerationOptions(max_tokens=24, temperature=0.0)


def run(backend, prompt, options=GREEDY, cancel=None):
    events = list(backend.generate(prompt, options, cancel))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    finish = events[-1]
    assert isinstance(finish, Finish)
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    return tokens, finish


def text_of(tokens, finish):
    return "".join(t.text for t in tokens) + finish.text


class BackendContract:
    def test_describes_its_model(self, backend):
        d = backend.description
        assert d.n_ctx >= 512 and d.n_vocab > 1000 and d.chat_template

    def test_tokenize_round_trips_plain_text(self, backend):
        text = "The quick brown fox jumps over 13 lazy dogs."
        ids = backend.tokenize(text, add_special=False)
        assert ids and all(isinstance(i, int) for i in ids)
        assert backend.detokenize(ids) == text
        assert backend.count_tokens(text) >= len(ids)

    def test_chat_template_renders_the_conversation(self, backend):
        prompt = backend.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Name a colour."}])
        assert "Be brief." in prompt and "Name a colour." in prompt

    def test_greedy_is_deterministic_and_text_matches_tokens(self, backend):
        a_tokens, a_finish = run(backend, "The capital of France is")
        b_tokens, b_finish = run(backend, "The capital of France is")
        assert [t.token_id for t in a_tokens] == [t.token_id for t in b_tokens]
        assert text_of(a_tokens, a_finish) == backend.detokenize([t.token_id for t in a_tokens])
        assert a_finish.completion_tokens == len(a_tokens)
        assert a_finish.prompt_tokens == len(backend.tokenize("The capital of France is"))

    def test_max_tokens_ends_with_length(self, backend):
        tokens, finish = run(backend, "Count: 1, 2, 3,", GenerationOptions(max_tokens=5, temperature=0))
        assert len(tokens) == 5 and finish.finish_reason == "length"

    def test_logprobs_are_a_distribution_and_greedy_picks_the_top(self, backend):
        tokens, _ = run(backend, "One, two, three,", GenerationOptions(max_tokens=6, temperature=0,
                                                                       top_logprobs=5))
        for t in tokens:
            assert t.logprob <= 0 and t.entropy >= 0
            assert len(t.top) == 5
            assert [x.logprob for x in t.top] == sorted((x.logprob for x in t.top), reverse=True)
            assert t.top[0].token_id == t.token_id
            assert math.isclose(t.top[0].logprob, t.logprob, abs_tol=1e-5)
            assert sum(math.exp(x.logprob) for x in t.top) <= 1.0 + 1e-4

    def test_seed_reproduces_sampling_at_temperature(self, backend):
        opts = GenerationOptions(max_tokens=16, temperature=1.0, seed=1234)
        a, _ = run(backend, "Once upon a time", opts)
        b, _ = run(backend, "Once upon a time", opts)
        assert [t.token_id for t in a] == [t.token_id for t in b]
        others = {tuple(t.token_id for t in run(backend, "Once upon a time",
                                                GenerationOptions(max_tokens=16, temperature=1.0, seed=s))[0])
                  for s in (1, 2, 3)}
        assert len(others) > 1

    def test_stop_string_cuts_the_text(self, backend):
        greedy, finish = run(backend, "Count: 1, 2, 3,", GenerationOptions(max_tokens=12, temperature=0))
        full = text_of(greedy, finish)
        assert "5" in full, full
        cut_tokens, cut = run(backend, "Count: 1, 2, 3,",
                              GenerationOptions(max_tokens=12, temperature=0, stop=("5",)))
        assert cut.finish_reason == "stop"
        assert text_of(cut_tokens, cut) == full[:full.index("5")]

    def test_cancel_stops_generation_promptly(self, backend):
        cancel = threading.Event()
        seen = 0
        for ev in backend.generate("1, 2, 3, 4,", GenerationOptions(max_tokens=200, temperature=0),
                                   cancel):
            if isinstance(ev, Finish):
                assert ev.finish_reason == "cancelled"
                break
            seen += 1
            if seen == 3:
                cancel.set()
        assert seen == 3
        tokens, finish = run(backend, "Hello")  # the backend is usable afterwards
        assert finish.finish_reason in ("stop", "length")

    def test_prompt_token_ids_are_accepted(self, backend):
        ids = backend.tokenize("The capital of France is")
        a, _ = run(backend, ids)
        b, _ = run(backend, "The capital of France is")
        assert [t.token_id for t in a] == [t.token_id for t in b]

    def test_prompt_longer_than_the_context_is_refused(self, backend):
        with pytest.raises(ValueError):
            list(backend.generate([1] * (backend.description.n_ctx + 1), GREEDY))

    def test_a_grammar_holds_the_answer_to_its_schema(self, backend):
        import json

        import jsonschema

        from cascade.protocol import ChatCompletionRequest
        from cascade.structured.contract import contract_of
        from cascade.structured.grammar import grammar_of

        schema = {"type": "object", "properties": {"size": {"enum": ["S", "M", "L"]},
                                                   "count": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["size", "count"]}
        fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "An order."}], response_format=fmt)
        grammar = grammar_of(contract_of(req), backend.special_tool_tags)
        prompt = backend.chat_prompt_tokens(backend.apply_chat_template([{"role": "user", "content": "An order."}]))
        for options in (GenerationOptions(max_tokens=40, temperature=0.0, grammar=grammar),
                        GenerationOptions(max_tokens=40, temperature=1.0, seed=3, grammar=grammar)):
            tokens, finish = run(backend, prompt, options)
            assert finish.finish_reason == "stop"
            jsonschema.validate(json.loads(text_of(tokens, finish)), schema)
            assert all(math.isfinite(t.logprob) and math.isfinite(t.entropy) for t in tokens)
