"""A cloud's embeddings as the edge agent relays them: rebuilt from what was checked, never passed on
as sent (the attacker's cloud: NaN vectors were a 500, a wrong count or size reached the app, a cloud
that switched weights was trusted on its old card)."""

from __future__ import annotations

import pytest

from cascade import errors
from cascade.embeddings import EmbeddingRequest, encode_vector
from edge_agent.server.embeddings import checked_cloud_answer

MODEL = "m@sha256:0123456789abcdef:mean:l2"


def answer(vectors, model=MODEL, indexes=None, tokens=5) -> dict:
    indexes = indexes if indexes is not None else range(len(vectors))
    return {"object": "list", "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "data": [{"object": "embedding", "index": i, "embedding": encode_vector(v, "base64")}
                     for i, v in zip(indexes, vectors, strict=True)], "extra": "<script>"}


def req(n=2, fmt="float") -> EmbeddingRequest:
    return EmbeddingRequest(model="m", input=[f"text {i}" for i in range(n)], encoding_format=fmt)


def test_a_good_answer_is_rebuilt_in_order_as_asked():
    out = checked_cloud_answer(answer([[0.0, 1.0], [1.0, 0.0]], indexes=[1, 0]), req(), MODEL)
    assert [d["embedding"] for d in out["data"]] == [[1.0, 0.0], [0.0, 1.0]]
    assert out["model"] == MODEL and out["usage"]["prompt_tokens"] == 5 and "extra" not in out
    assert isinstance(checked_cloud_answer(answer([[0.5], [0.5]]), req(fmt="base64"), MODEL)["data"][0]["embedding"],
                      str)


@pytest.mark.parametrize("bad", [
    answer([[float("nan"), 1.0], [1.0, 0.0]]),
    answer([[0.0, 1.0]]),  # one vector for two inputs
    answer([[0.0, 1.0], [1.0, 0.0]], indexes=[0, 0]),
    answer([[0.0, 1.0], [1.0, 0.0]], indexes=[0, 7]),
    answer([[0.0, 1.0], [1.0, 0.0, 2.0]]),
    answer([[], []]),
    {"model": MODEL, "data": "nope"},
    {"model": MODEL, "data": [{"index": 0, "embedding": "!!"}, {"index": 1, "embedding": 3}]},
])
def test_a_malformed_answer_is_a_502(bad):
    with pytest.raises(errors.APIError) as e:
        checked_cloud_answer(bad, req(), MODEL)
    assert e.value.status == 502 and e.value.code == "bad_upstream"


def test_an_answer_from_other_weights_is_a_409_and_usage_is_clamped():
    with pytest.raises(errors.APIError) as e:
        checked_cloud_answer(answer([[0.0, 1.0], [1.0, 0.0]], model="m@sha256:0000000000000000:mean:l2"), req(), MODEL)
    assert e.value.status == 409 and e.value.code == "embedding_model_mismatch"
    out = checked_cloud_answer(answer([[0.0, 1.0], [1.0, 0.0]], tokens=2**70), req(), MODEL)
    assert out["usage"]["prompt_tokens"] == 2**31 - 1
