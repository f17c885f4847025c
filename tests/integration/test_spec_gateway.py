"""A device's draft through the gateway (issue 40): the gateway names its model's tokenizer in
/v1/models, takes a draft naming the same, carries it in the request record, and the answer is
the one the request gets without a draft, with ``cascade.draft`` saying what was kept, across a
prefill/decode pair (the prefill worker's first token confirms the draft's first, the decode
worker verifies the rest in its first step). A worker that runs the whole request is covered end
to end from the edge agent (tests/integration/test_cascade.py, the low-confidence case)."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import Server, create_key
from tests.integration.pair_helpers import MODEL

PROMPT = "The three primary colours are"


def _worker(home, role: str) -> Server:
    return Server(home, ["cloud", "worker"], "--role", role, "--model", MODEL, "--max-model-len", "1024",
                  "--kv-cache-bytes", str(64 << 20), "--threads", "1")


@pytest.fixture(scope="module")
def gateways(engine_home, smollm2_engine):  # the engine fixture has converted the model already
    servers: list[Server] = []
    try:
        prefill, decode = (_worker(engine_home, r) for r in ("prefill", "decode"))
        servers += [prefill, decode]
        for w in servers:
            w.wait_healthy()
        pd = Server(engine_home, ["cloud", "serve"], "--workers", f"{prefill.url},{decode.url}")
        servers.append(pd)
        pd.wait_healthy(120)
        key = create_key(engine_home, "--tenant", "drafts")
        yield {"pd": pd}, {"authorization": f"Bearer {key}"}
    finally:
        for s in reversed(servers):
            s.stop()


_SEEDS = iter(range(1, 1 << 30))


def _ask(gateway: Server, auth: dict, draft: dict | None = None, stream: bool = False) -> dict:
    # a seed of its own keys each request apart in the result cache (greedy output ignores it)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "seed": next(_SEEDS)}
    if draft is not None:
        body["cascade"] = {"draft": draft}
    if not stream:
        r = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=auth, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()
    text, last = "", {}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json={**body, "stream": True}, headers=auth,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = httpx.Response(200, content=line[6:]).json()
                text += "".join(c.get("text") or "" for c in last.get("choices") or [])
    return {"choices": [{"text": text}], "cascade": last.get("cascade")}


@pytest.mark.parametrize("path", ["pd"])
def test_a_draft_is_verified_and_the_answer_is_the_one_without_it(gateways, smollm2_engine, path):
    servers, auth = gateways
    gateway = servers[path]
    (card,) = httpx.get(f"{gateway.url}/v1/models", headers=auth, timeout=10).json()["data"]
    identity = card["meta"]["tokenizer"]
    assert len(identity) == 64
    plain = _ask(gateway, auth)
    text = plain["choices"][0]["text"]
    ids = smollm2_engine.tokenizer.encode(text, add_special_tokens=False)[:8]
    assert len(ids) >= 4
    right = _ask(gateway, auth, {"token_ids": ids, "probs": [1.0] * len(ids), "tokenizer": identity})
    assert right["choices"][0]["text"] == text
    assert right["cascade"]["draft"]["offered"] == len(ids) and right["cascade"]["draft"]["accepted"] >= 2
    streamed = _ask(gateway, auth, {"token_ids": ids, "tokenizer": identity}, stream=True)
    assert streamed["choices"][0]["text"] == text and streamed["cascade"]["draft"]["offered"] == len(ids)
    wrong = [(ids[0] + 1) % 100 + 1] + ids[1:]  # off at its first token: nothing of it is kept
    off = _ask(gateway, auth, {"token_ids": wrong, "tokenizer": identity})
    assert off["choices"][0]["text"] == text and off["cascade"]["draft"] == {"offered": len(ids), "accepted": 0}
    other = _ask(gateway, auth, {"token_ids": ids, "tokenizer": "f" * 64})  # another model's tokenizer
    assert other["choices"][0]["text"] == text and not (other.get("cascade") or {}).get("draft")


def test_a_draft_of_ids_past_the_vocabulary_is_a_400_naming_it(gateways):
    servers, auth = gateways
    gateway = servers["pd"]
    identity = httpx.get(f"{gateway.url}/v1/models", headers=auth, timeout=10).json()["data"][0]["meta"]["tokenizer"]
    r = httpx.post(f"{gateway.url}/v1/completions", headers=auth, timeout=60, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 4,
        "cascade": {"draft": {"token_ids": [1, 10**6], "tokenizer": identity}}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("cascade.draft.token_ids"), r.text


def test_the_result_cache_keeps_no_draft_report_and_no_sampled_answer_drawn_against_a_draft(gateways):
    servers, auth = gateways
    gateway = servers["pd"]
    identity = httpx.get(f"{gateway.url}/v1/models", headers=auth, timeout=10).json()["data"][0]["meta"]["tokenizer"]
    draft = {"token_ids": [1, 2, 3], "probs": [1.0, 1.0, 1.0], "tokenizer": identity}

    def post(body):
        r = httpx.post(f"{gateway.url}/v1/completions", headers=auth, timeout=120, json=body)
        assert r.status_code == 200, r.text
        return r.headers["x-cascade-cache"], r.json()

    greedy = {"model": MODEL, "prompt": PROMPT + " (cache)", "max_tokens": 8, "temperature": 0}
    first = post({**greedy, "cascade": {"draft": draft}})
    assert first[0] == "miss" and first[1]["cascade"]["draft"]["offered"] == 3
    again = post(greedy)  # the same greedy answer, from the cache: without the other request's draft report
    assert again[0] == "hit" and again[1]["choices"] == first[1]["choices"]
    assert "draft" not in (again[1].get("cascade") or {})
    sampled = {**greedy, "temperature": 0.8, "seed": 5, "prompt": PROMPT + " (sampled)"}
    assert post({**sampled, "cascade": {"draft": draft}})[0] == "miss"
    assert post(sampled)[0] == "miss"  # the seed's own answer was never stored from the drafted one
