"""The worker's side of a device's draft: ``cascade.draft`` in /v1/chat/completions and
/v1/completions bodies, used when its ``tokenizer`` is the worker's own identity (``GET /v1/models``
says which), reported in the answer's ``cascade`` object and in /metrics; a malformed draft is a
400 naming ``cascade.draft...``; another tokenizer's draft runs the request as without it."""

from __future__ import annotations

import json
import math

import pytest
from fastapi.testclient import TestClient

from cloud_tier.config import CloudConfig, WorkerConfig
from cloud_tier.engine import LLMEngine
from cloud_tier.engine_config import EngineConfig
from cloud_tier.worker.app import build_app
from model_distribution.artifacts.tokenizer_identity import tokenizer_identity
from tests.tiny_qwen2 import make_tiny_qwen2
from tests.unit.engine.spec_models import plain_greedy

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("qwen2"), tie=True)


@pytest.fixture(scope="module")
def client(tiny):
    config = CloudConfig(engine=EngineConfig(model=str(tiny), dtype="float32", max_model_len=512, block_size=4,
                                             num_kv_blocks=256, threads=1), worker=WorkerConfig(role="prefill"))
    with TestClient(build_app(config)) as c:
        yield c


def complete(client, draft=None, **body):
    payload = {"model": client.model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, **body}
    if draft is not None:
        payload["cascade"] = {"draft": draft}
    return client.post("/v1/completions", json=payload)


@pytest.fixture(scope="module")
def served(client):
    r = client.get("/v1/models")
    assert r.status_code == 200, r.text
    card = r.json()["data"][0]
    client.model = card["id"]
    return card


@pytest.fixture(scope="module")
def plain(client, served, tiny):
    """The plain answer's text, and its token ids (from an engine of the same model alone)."""
    r = complete(client)
    assert r.status_code == 200 and r.json().get("cascade") is None
    alone = LLMEngine.from_model(str(tiny), dtype="float32", max_model_len=512, block_size=4, num_kv_blocks=256)
    return r.json()["choices"][0]["text"], plain_greedy(alone, list(PROMPT.encode()), 16)


def test_models_lists_the_tokenizer_identity(served, tiny):
    assert served["tokenizer"] == tokenizer_identity(tiny) and len(served["tokenizer"]) == 64


def test_a_draft_of_this_tokenizer_is_verified_and_reported(client, served, plain):
    text, ids = plain
    draft_ids = ids[:8]
    r = complete(client, {"token_ids": draft_ids, "probs": None, "top": None, "tokenizer": served["tokenizer"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text
    assert r.json()["cascade"] == {"draft": {"offered": 8, "accepted": 8}}
    wrong = [*draft_ids[:2], (draft_ids[2] + 1) % 256, *draft_ids[3:]]
    chat = client.post("/v1/completions", json={"model": served["id"], "prompt": PROMPT, "max_tokens": 16,
                                                "temperature": 0, "stream": True,
                                                "cascade": {"draft": {"token_ids": wrong,
                                                                      "tokenizer": served["tokenizer"]}}})
    events = [json.loads(line[6:]) for line in chat.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == text
    assert events[-1]["cascade"] == {"draft": {"offered": 8, "accepted": 2}}
    metrics = client.get("/metrics").text
    assert 'cascade_worker_drafts_total{outcome="verified"} 2.0' in metrics
    assert "cascade_worker_draft_tokens_accepted_total 10.0" in metrics


def test_another_tokenizers_draft_runs_as_without_and_reports_nothing(client, served, plain):
    r = complete(client, {"token_ids": [1, 2, 3], "tokenizer": "0" * 64})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain[0]
    assert r.json().get("cascade") is None


def test_chat_takes_a_draft_too(client, served):
    body = {"model": served["id"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    r = client.post("/v1/chat/completions", json={**body, "cascade": {"draft": {"token_ids": [65],
                                                                                 "tokenizer": served["tokenizer"]}}})
    assert r.status_code == 200, r.text
    assert r.json()["cascade"]["draft"]["offered"] == 1


@pytest.mark.parametrize(("draft", "param"), [
    ({"token_ids": [1, 10**6]}, "cascade.draft.token_ids[1]"),
    ({"token_ids": [1, 2], "probs": [0.5]}, "cascade.draft"),
    ({"token_ids": [1, 2], "probs": [0.5, 1.5]}, "cascade.draft.probs"),
    ({"token_ids": [1] * 10_000}, "cascade.draft.token_ids"),
    ({"token_ids": "abc"}, "cascade.draft.token_ids"),
    ({"token_ids": [1], "top": [[[1, 0.5], [2]]]}, "cascade.draft.top"),
    ({"token_ids": [1], "top": [[[1, 0.5], [1, 0.25]]]}, "cascade.draft.top[0]"),  # a token listed twice
    ({"token_ids": [1], "probs": [0.0]}, "cascade.draft.probs[0]"),  # a drafted token it gave no mass
    ({"token_ids": [1], "colour": "red"}, "cascade.draft.colour"),
    ({"token_ids": [1], "tokenizer": None}, "cascade.draft.tokenizer"),
])
def test_a_malformed_draft_is_a_400_naming_its_field(client, served, draft, param):
    r = complete(client, {"tokenizer": served["tokenizer"], **draft})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)  # the schema's own path (probs.1) or the check's


def test_a_nan_probability_is_a_400(client, served):
    body = json.dumps({"model": served["id"], "prompt": "x", "max_tokens": 2,
                       "cascade": {"draft": {"token_ids": [1], "probs": [math.nan], "tokenizer": served["tokenizer"]}}})
    assert "NaN" in body
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400  # the body's JSON has no NaN: refused before the draft is read
