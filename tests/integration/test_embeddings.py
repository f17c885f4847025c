"""/v1/embeddings on the edge agent, the cloud worker and the gateway (SmolLM2-135M): the official
openai client (float and its default base64), the same vectors on both tiers, a sane ranking, batch
== one by one, token ids == text, every bad input a 400 naming its field, and the edge's escalation
only to the same embedding identity."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import openai
import pytest

from cascade.embeddings import decode_base64
from tests import loopback
from tests.conftest import create_key, gateway_count

PAIRS = [  # (query, its document): each query's nearest document should be its own
    ("How do I bake bread at home?",
     "Mix flour, water, yeast and salt, let the dough rise, then bake it in a hot oven."),
    ("What is the capital of France?", "Paris is the capital and largest city of France."),
    ("How do vaccines protect against disease?",
     "Vaccines train the immune system to recognise a pathogen and fight it."),
    ("Which planet is the largest in the solar system?", "Jupiter is the biggest planet orbiting the Sun."),
    ("How do I reverse a list in Python?", "Call list.reverse() or use slicing with [::-1] to reverse a Python list."),
    ("Why is the sky blue?", "Sunlight is scattered by air molecules, and blue light scatters the most."),
]
TEXTS = [q for q, _ in PAIRS] + [d for _, d in PAIRS]
DIM = 576  # SmolLM2-135M's hidden size


@pytest.fixture(scope="module")
def gateway_key(engine_home, cloud_both):
    return create_key(engine_home, "--tenant", "embeddings")


@pytest.fixture(scope="module")
def servers(agent, cloud_worker, cloud_both, gateway_key):
    """name -> (openai client, base url, bearer key) of each server."""
    def one(url, key):
        return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120), url, key
    return {"edge": one(agent.url, "unused"), "worker": one(cloud_worker.url, "unused"),
            "gateway": one(cloud_both.url, gateway_key)}


def _vectors(client, texts, **kw) -> np.ndarray:
    r = client.embeddings.create(model="smollm2-135m", input=texts, **kw)
    n = 1 if isinstance(texts, str) or isinstance(texts[0], int) else len(texts)
    assert [d.index for d in r.data] == list(range(n))
    return np.array([d.embedding for d in r.data])


def _card_identity(url: str, key: str) -> str:
    cards = loopback.get(f"{url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=60).json()["data"]
    return cards[0]["meta"]["embedding"]


@pytest.mark.parametrize("name", ["edge", "worker", "gateway"])
def test_openai_client_embeds_as_float_and_base64(servers, name):
    client, url, key = servers[name]
    r = client.embeddings.create(model="smollm2-135m", input=["hello world", "a second input"])  # base64 by default
    assert r.object == "list" and len(r.data) == 2 and all(len(d.embedding) == DIM for d in r.data)
    assert r.usage.prompt_tokens == r.usage.total_tokens > 2
    identity = _card_identity(url, key)
    assert identity.startswith("sha256:") and identity.endswith(":mean:l2")
    assert r.model == f"smollm2-135m@{identity}"
    as_float = client.embeddings.create(model="smollm2-135m", input=["hello world", "a second input"],
                                        encoding_format="float")
    for a, b in zip(r.data, as_float.data, strict=True):
        assert np.linalg.norm(a.embedding) == pytest.approx(1.0, abs=1e-5)
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)
    raw = loopback.post(f"{url}/v1/embeddings", json={"model": "smollm2-135m", "input": "hello world",
                                                       "encoding_format": "base64"},
                        headers={"authorization": f"Bearer {key}"}, timeout=60).json()
    np.testing.assert_allclose(decode_base64(raw["data"][0]["embedding"]), r.data[0].embedding, atol=1e-6)


def test_both_tiers_give_the_same_vectors_and_a_sane_ranking(servers):
    edge = _vectors(servers["edge"][0], TEXTS, encoding_format="float")
    cloud = _vectors(servers["worker"][0], TEXTS, encoding_format="float")
    # Q4_1 in llama.cpp against the dequantized float32 engine: measured cosine 0.99964 at worst
    assert (edge * cloud).sum(axis=1).min() > 0.995
    assert len({_card_identity(url, key) for _, url, key in servers.values()}) == 1  # one identity everywhere
    for v in (edge, cloud):
        sims = v[:6] @ v[6:].T
        # measured: 5 of 6 on both tiers (bread's query is as close to the vaccines' answer)
        assert (sims.argmax(axis=1) == np.arange(6)).sum() >= 5
        own, others = np.diag(sims).mean(), sims[~np.eye(6, dtype=bool)].mean()
        assert own > others + 0.08  # measured ~0.85 against ~0.68


@pytest.mark.parametrize("name", ["edge", "worker"])
def test_batch_equals_one_by_one_and_token_ids_equal_text(servers, smollm2_engine, name):
    client = servers[name][0]
    batch = _vectors(client, TEXTS[:4], encoding_format="float")
    single = np.array([_vectors(client, [t], encoding_format="float")[0] for t in TEXTS[:4]])
    np.testing.assert_allclose(batch, single, atol=1e-5)
    ids = [smollm2_engine.tokenizer.encode(t) for t in TEXTS[:2]]
    np.testing.assert_allclose(_vectors(client, ids, encoding_format="float"), batch[:2], atol=1e-5)
    np.testing.assert_allclose(_vectors(client, ids[0], encoding_format="float")[0], batch[0], atol=1e-5)


BAD = [  # (body, the field its 400 names)
    ({"model": "smollm2-135m", "input": ""}, "input"),
    ({"model": "smollm2-135m", "input": []}, "input"),
    ({"model": "smollm2-135m", "input": [[]]}, "input"),
    ({"model": "smollm2-135m", "input": ["x"] * 100_000}, "input"),
    ({"model": "smollm2-135m", "input": [1, 2, 10**9]}, "input"),  # outside the vocabulary
    ({"model": "smollm2-135m", "input": [1, -1]}, "input"),
    ({"model": "smollm2-135m", "input": [1.5, 2]}, "input"),
    ({"model": "smollm2-135m", "input": ["a", 3]}, "input"),
    ({"model": "smollm2-135m", "input": [True]}, "input"),
    ({"model": "smollm2-135m", "input": {"text": "a"}}, "input"),
    ({"model": "smollm2-135m", "input": "word " * 3000}, "input"),  # past the context, no truncation asked
    ({"model": "smollm2-135m", "input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "smollm2-135m", "input": "a", "dimensions": 64}, "dimensions"),
    ({"model": "smollm2-135m", "input": "a", "dimensions": "576"}, "dimensions"),
    ({"model": "smollm2-135m", "input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"model": "smollm2-135m", "input": "a", "truncate_prompt_tokens": 5000}, "truncate_prompt_tokens"),
    ({"model": "smollm2-135m", "input": "a", "user": 7}, "user"),
    ({"model": 3, "input": "a"}, "model"),
    ({"input": "a"}, "model"),
    ({"model": "smollm2-135m", "input": "a", "bogus": 1}, "bogus"),
]


@pytest.mark.parametrize("name", ["edge", "worker", "gateway"])
def test_bad_inputs_are_400s_naming_the_field_and_the_server_still_serves(servers, name):
    client, url, key = servers[name]
    headers = {"authorization": f"Bearer {key}"}
    for body, field in BAD:
        r = loopback.post(f"{url}/v1/embeddings", json=body, headers=headers, timeout=60)
        assert r.status_code == 400, (body, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == field, (body, err)
        assert set(err) == {"message", "type", "param", "code"}
    # -1: the last n_ctx tokens (1024: 4.3 s in llama.cpp on this 2-core machine, so the cloud only)
    keep = -1 if name != "edge" else 16
    r = loopback.post(f"{url}/v1/embeddings", json={"model": "smollm2-135m", "input": "word " * 3000,
                                                     "truncate_prompt_tokens": keep}, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == (1024 if keep == -1 else keep)
    assert len(client.embeddings.create(model="smollm2-135m", input="still here").data[0].embedding) == DIM


def test_gateway_charges_the_tenant_and_refuses_past_its_quota(engine_home, cloud_both):
    key = create_key(engine_home, "--tenant", "embeddings-quota", "--tpm", "60")
    headers = {"authorization": f"Bearer {key}"}
    r = loopback.post(f"{cloud_both.url}/v1/embeddings", json={"model": "smollm2-135m", "input": list(range(1, 100))},
                      headers=headers, timeout=60)
    assert r.status_code == 429 and r.json()["error"]["code"] == "tokens_exceed_quota"
    r = loopback.post(f"{cloud_both.url}/v1/embeddings", json={"model": "smollm2-135m", "input": list(range(1, 40))},
                      headers=headers, timeout=60)
    assert r.status_code == 200
    r = loopback.post(f"{cloud_both.url}/v1/embeddings", json={"model": "smollm2-135m", "input": list(range(1, 40))},
                      headers=headers, timeout=60)
    assert r.status_code == 429  # 39 + 39 tokens > 60 a minute
    assert loopback.post(f"{cloud_both.url}/v1/embeddings", json={"model": "smollm2-135m", "input": "a"},
                         timeout=60).status_code == 401
    assert gateway_count(cloud_both, "embeddings-quota", endpoint="embeddings", outcome="ok") == 1


def test_edge_escalates_only_to_the_same_embedding_identity(servers, agent, cloud_both, gateway_key, smollm2_path):
    """The agent's cloud path (edge_agent.server.embeddings) against the real gateway: the same
    identity is served from the cloud; another one is a 409 naming why."""
    from cascade.embeddings import EmbeddingRequest
    from cascade.errors import APIError
    from edge_agent.config import EdgeConfig, UpstreamConfig
    from edge_agent.server.embeddings import EdgeEmbeddings
    from edge_agent.upstream import Upstream

    description = types.SimpleNamespace(format="gguf", path=smollm2_path, name="smollm2-135m")
    body = {"model": "smollm2-135m", "input": TEXTS[:2], "encoding_format": "float", "cascade": {"mode": "cloud"}}
    req = EmbeddingRequest.model_validate(body)

    async def ask(identity: str | None):
        upstream = Upstream(UpstreamConfig(url=cloud_both.url, api_key=gateway_key))
        emb = EdgeEmbeddings(EdgeConfig())
        if identity is not None:
            emb._identities[smollm2_path] = identity  # noqa: SLF001 (a device whose model is another)
        try:
            return await emb.cloud(upstream, req, body, description)
        finally:
            await upstream.close()

    resp = asyncio.run(ask(None))
    assert resp.status_code == 200 and resp.headers["x-cascade-tier"] == "cloud"
    import json

    answer = json.loads(resp.body)
    np.testing.assert_allclose([d["embedding"] for d in answer["data"]],
                               _vectors(servers["gateway"][0], TEXTS[:2], encoding_format="float"), atol=1e-6)
    with pytest.raises(APIError) as refused:
        asyncio.run(ask("sha256:0000000000000000:mean:l2"))
    assert refused.value.status == 409 and refused.value.code == "embedding_model_mismatch"
    assert "not be comparable" in refused.value.message
