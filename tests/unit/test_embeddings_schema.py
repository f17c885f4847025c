"""The embeddings wire contract (cascade/embeddings.py, cascade/embedding_identity.py) and the
gateway's pass-through to a foreign worker, without a model."""

from __future__ import annotations

import asyncio
import json
import os
import types

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cascade import errors
from cascade.embedding_identity import cloud_mismatch, embedding_identity, identity_of_card, weights_sha256
from cascade.embeddings import EmbeddingRequest, decode_base64, embedding_response, encode_vector, token_lists
from cascade.web import parse_body


def test_the_four_input_shapes_become_inputs():
    def inputs(x):
        return parse_body(EmbeddingRequest, {"model": "m", "input": x}).inputs()
    assert inputs("a") == ["a"]
    assert inputs(["a", "b"]) == ["a", "b"]
    assert inputs([1, 2]) == [[1, 2]]
    assert inputs([[1], [2, 3]]) == [[1], [2, 3]]


def test_truncation_keeps_the_last_tokens_and_an_overlong_input_is_refused():
    def tokenize(s):
        return list(range(1, len(s) + 1))
    req = parse_body(EmbeddingRequest, {"model": "m", "input": ["abcdef", "abc"], "truncate_prompt_tokens": 2})
    assert token_lists(req, tokenize, 100, 8) == [[5, 6], [2, 3]]
    req = parse_body(EmbeddingRequest, {"model": "m", "input": [[7, 8, 9]], "truncate_prompt_tokens": 2})
    assert token_lists(req, tokenize, 100, 8) == [[8, 9]]
    req = parse_body(EmbeddingRequest, {"model": "m", "input": "x" * 9, "truncate_prompt_tokens": -1})
    assert token_lists(req, tokenize, 100, 8) == [list(range(2, 10))]
    with pytest.raises(errors.APIError) as e:
        token_lists(parse_body(EmbeddingRequest, {"model": "m", "input": "x" * 9}), tokenize, 100, 8)
    assert (e.value.status, e.value.param, e.value.code) == (400, "input", "context_length_exceeded")
    with pytest.raises(errors.APIError) as e:
        token_lists(parse_body(EmbeddingRequest, {"model": "m", "input": [5, 100]}), tokenize, 100, 8)
    assert e.value.param == "input"
    many = parse_body(EmbeddingRequest, {"model": "m", "input": ["abcd"] * 5})
    assert len(token_lists(many, tokenize, 100, 8, max_total=20)) == 5
    with pytest.raises(errors.APIError) as e:  # what bounds one request's time
        token_lists(many, tokenize, 100, 8, max_total=19)
    assert (e.value.param, e.value.code) == ("input", "too_many_tokens")


def test_base64_is_little_endian_float32_as_openai_sends_it():
    import base64
    import struct

    v = [0.5, -1.25, 3.0]
    assert encode_vector(v, "base64") == base64.b64encode(struct.pack("<3f", *v)).decode()
    assert decode_base64(encode_vector(v, "base64")) == v
    body = embedding_response("m@id", [v], "float", 3)
    assert body == {"object": "list", "model": "m@id", "data": [{"object": "embedding", "index": 0, "embedding": v}],
                    "usage": {"prompt_tokens": 3, "total_tokens": 3}}


def test_identity_is_hashed_once_and_kept_in_a_sidecar(tmp_path):
    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"GGUF" + b"\0" * 1000)
    first = embedding_identity(weights, "mean", home=tmp_path)
    import hashlib

    assert first == f"sha256:{hashlib.sha256(weights.read_bytes()).hexdigest()[:16]}:mean:l2"
    (sidecar,) = (tmp_path / "cache" / "sha256").iterdir()
    sidecar.write_text("f" * 64)  # the cached digest is what is read while size and mtime hold
    assert weights_sha256(weights, home=tmp_path) == "f" * 64
    os.utime(weights, ns=(1, 1))
    assert weights_sha256(weights, home=tmp_path) == hashlib.sha256(weights.read_bytes()).hexdigest()


@pytest.mark.parametrize(("local", "card", "refused"), [
    ("sha256:ab:mean:l2", {"meta": {"embedding": "sha256:ab:mean:l2"}}, False),
    ("sha256:ab:mean:l2", {"meta": {"embedding": "sha256:cd:mean:l2"}}, True),  # another model
    ("sha256:ab:mean:l2", {"meta": {"embedding": "sha256:ab:cls:l2"}}, True),  # another pooling
    ("sha256:ab:mean:l2", {"meta": {"tokenizer": "t"}}, True),  # a cloud that states none (a vLLM)
    ("sha256:ab:mean:l2", {"meta": {"embedding": 7}}, True),
    ("sha256:ab:mean:l2", "garbage", True),
    ("", {"meta": {"embedding": ""}}, True),
])
def test_the_cloud_is_used_only_for_the_same_embedding_identity(local, card, refused):
    decision = cloud_mismatch(local, identity_of_card(card), "cloud-model")
    assert (decision is not None) == refused
    if refused:
        assert decision.status == 409 and decision.code == "embedding_model_mismatch"
        assert decision.body()["error"]["type"] == "invalid_request_error"


SCALARS = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=8)
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                    max_leaves=20)
FIELD_NAMES = ["model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens", "cascade",
               "other"]
FIELDS = st.sampled_from(FIELD_NAMES)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(FIELDS, JSON | st.sampled_from(["m", "float", "base64", 576, -1, [1, 2], [[3]], ["a"]]),
                       max_size=7))
def test_any_json_body_is_parsed_or_a_400_never_anything_else(body):
    try:
        req = parse_body(EmbeddingRequest, body)
    except errors.APIError as e:
        assert e.status == 400 and e.type == "invalid_request_error"
        assert e.param is None or e.param.split(".")[0] in FIELD_NAMES
        return
    try:  # what a tier does next: its own checks are 400s too
        ids = token_lists(req, lambda s: [1] * len(s), 1000, 64)
    except errors.APIError as e:
        assert e.status == 400 and e.param in ("input", "truncate_prompt_tokens")
        return
    assert ids and all(0 <= t < 1000 for seq in ids for t in seq)


def test_the_gateway_passes_a_foreign_workers_body_and_answer_through():
    """Its pipeline step (cloud_tier/gateway/pipeline/embeddings.py) on a fake vLLM: the body goes
    unchanged, its answer comes back unchanged, the quota is settled with the tokens it reports."""
    from cloud_tier.gateway.pipeline import embeddings as pipeline

    seen = []
    answer = {"object": "list", "model": "vllm-model", "data": [{"object": "embedding", "index": 0,
                                                                  "embedding": [1.0, 0.0]}],
              "usage": {"prompt_tokens": 3, "total_tokens": 3}}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), request.content))
        return httpx.Response(200, json=answer)

    reconciled, counted = [], []
    worker = types.SimpleNamespace(url="http://vllm:8000", is_foreign=True, available=lambda: True)

    async def no_quota_check(flight, n):
        pass

    async def reconcile(q, predicted, used):
        reconciled.append((q.tenant, q.key_id, predicted, used))

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            svc = types.SimpleNamespace(
                pool=types.SimpleNamespace(workers={"w": worker}, foreign=True, client=client, headers={}),
                config=types.SimpleNamespace(worker_max_body_bytes=1 << 20, request_timeout_s=5.0),
                check_model=lambda m: None, _check_quota=no_quota_check,
                state=types.SimpleNamespace(reconcile=reconcile),
                count=lambda *a: counted.append(a))
            key = types.SimpleNamespace(tenant="t", key_id="k")
            return await pipeline.serve(svc, key, {"model": "vllm-model", "input": "hello there"})

    status, got = asyncio.run(run())
    assert (status, got) == (200, answer)
    assert [(url, json.loads(content)) for url, content in seen] == [
        ("http://vllm:8000/v1/embeddings", {"model": "vllm-model", "input": "hello there"})]
    assert reconciled == [("t", "k", 3, 3)] and counted == [("t", "embeddings", "ok")]
