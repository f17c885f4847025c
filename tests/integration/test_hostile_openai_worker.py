"""The hostile-worker harness for OpenAI-compatible workers (`--worker-type openai`): a fake
worker (tests/integration/faulty_openai.py, no model behind it) that lies about usage, sends
empty streams, only [DONE], giant chunks, malformed JSON, chunks and bodies not OpenAI-shaped
(item 2), U+2028 inside a chunk, and stalls at every stage. Whatever it does, every answer is a
well-formed 200 or an OpenAI-style 502/504 (never a 500), every stream ends with [DONE], the
tenant's charge, quota bucket and counters stay within what its requests could use, an
Idempotency-Key's retry is answered at once, and the next honest request succeeds. Also: an
answer without usage is a completed answer (issue 37 item 5), X-Cascade-Deadline is kept (item 7)."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.conftest import Server, create_key
from tests.integration.faulty_openai import MODEL, FaultyOpenAIWorker, Mode, honest_body, honest_chunks, sse, usage
from tests.integration.worker_checks import new_key, post, run_harness, samples, total, well_formed

STALL = 1.5  # the fake's stalls; the gateway below gives up after 0.5 s (first chunk) or 1 s (anything else)
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "Name two colours."}], "max_tokens": 8,
       "temperature": 0}
LIES = {"negative": usage(-5, -3), "huge": usage(10**12, 10**12), "overflow": usage(10**400, 1),
        "float": usage(9.5, 3.0), "string": usage("9", "3"), "missing": "missing"}


def lying_stream(lie) -> list:
    chunks = honest_chunks()
    if lie == "missing":
        return sse(*chunks[:-1], "[DONE]")
    return sse(*chunks[:-1], {**chunks[-1], "usage": lie}, "[DONE]")


def script(case: str, stream: bool) -> Mode:
    """What the worker answers in ``case``, to a streamed request or not."""
    chunks, body = sse(*honest_chunks(), "[DONE]"), json.dumps(honest_body())
    if case in LIES:
        return Mode(script=lying_stream(LIES[case]) if stream else [json.dumps(honest_body(usage_=LIES[case]))])
    return Mode(**{
        "empty": dict(script=[]),
        "only_done": dict(script=sse("[DONE]")),
        "giant_chunk": dict(script=sse(*honest_chunks(words=("x" * (100 << 10),)), "[DONE]") if stream
                            else [json.dumps(honest_body(text="x" * (200 << 10)))]),
        "malformed": dict(script=[*sse(honest_chunks()[0]), "data: {not json\n\n"] if stream else ["{not json"]),
        "nan_usage": dict(script=[*chunks[:-2], 'data: {"choices":[],"usage":{"prompt_tokens":NaN}}\n\n', chunks[-1]]
                          if stream else [body.replace('"prompt_tokens": 9', '"prompt_tokens": NaN')]),
        "in_band_error": dict(script=sse({"error": {"message": "boom", "type": "server_error"}}, "[DONE]")),
        # issue 42's relay: chunks without "data:" are no chunks (an empty stream); SSE comments and other
        # fields between honest chunks are skipped, the chunks relayed as they came
        "no_data_prefix": dict(script=[json.dumps(c) + "\n\n" for c in honest_chunks()] + ["data: [DONE]\n\n"]
                               if stream else [json.dumps(honest_body()) + "\n\n" + json.dumps(honest_body())]),
        "sse_comments": dict(script=[": ping\n\n", "event: completion\nid: 7\n", *chunks[:1], "retry: 10\n\n",
                                     *chunks[1:]] if stream else [body]),
        "choices_not_a_list": dict(script=sse({"choices": 5}, "[DONE]") if stream else ['{"choices": 5}']),
        # item 2: shapes that once passed, were cached, and broke the other shape's replay (a 500)
        "string_delta": dict(script=sse({"choices": [{"index": 0, "delta": "stringdelta"}]}, "[DONE]") if stream
                             else ['{"choices": [{"index": 0, "message": "stringmessage"}]}']),
        "choice_not_a_dict": dict(script=sse({"choices": ["notadict"]}, "[DONE]") if stream
                                  else ['{"choices": ["notadict"]}']),
        "bad_mid_stream": dict(script=sse(*honest_chunks()[:1], {"choices": [{"index": 0, "delta": {"content": 5}}]},
                                          "[DONE]") if stream
                               else ['{"choices": [{"index": 0, "message": {"content": 5}}]}']),
        "stall_before_headers": dict(stall_s=STALL, script=chunks if stream else [body]),
        "stall_after_headers": dict(script=[STALL, *chunks] if stream else [STALL, body]),
        "stall_mid_stream": dict(script=[chunks[0], STALL, *chunks[1:]] if stream else [body[:20], STALL, body[20:]]),
        "stall_before_done": dict(script=[*chunks[:-1], STALL, chunks[-1]] if stream else [body[:-1], STALL, "}"]),
    }[case])


SHAPES = ["string_delta", "choice_not_a_dict", "bad_mid_stream"]
CASES = [*LIES, "empty", "only_done", "giant_chunk", "malformed", "nan_usage", "in_band_error", "choices_not_a_list",
         "no_data_prefix", "sse_comments",
         *SHAPES, "stall_before_headers", "stall_after_headers", "stall_mid_stream", "stall_before_done"]
FAILS = {"empty", "only_done", "giant_chunk", "malformed", "nan_usage", "in_band_error", "choices_not_a_list",
         "no_data_prefix",
         *SHAPES, "stall_before_headers", "stall_after_headers", "stall_mid_stream", "stall_before_done"}
# streamed: after the first chunk
MID_STREAM = {"malformed", "nan_usage", "bad_mid_stream", "stall_mid_stream", "stall_before_done"}


@pytest.fixture(scope="module")
def fake():
    w = FaultyOpenAIWorker().start()
    yield w
    w.stop()


@pytest.fixture(autouse=True)
def honest_again(fake):
    fake.mode = Mode()
    yield
    fake.mode = Mode()


def start_gateway(home, fake, **env) -> Server:
    g = Server(home, ["cloud", "serve"], "--workers", fake.url, "--worker-type", "openai",
               env={f"CASCADE_CLOUD_GATEWAY_{k.upper()}": str(v) for k, v in env.items()}).wait_healthy(60)
    g.home = home
    g.admin = create_key(home, "--tenant", "owner", "--admin")
    return g


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, fake):
    g = start_gateway(tmp_path_factory.mktemp("hostile-openai"), fake, first_token_timeout_s=0.5,
                      request_timeout_s=1.0, retries=0, breaker_threshold=1000, worker_max_event_bytes=65536,
                      worker_max_body_bytes=131072, metrics_interval_s=0.2)
    yield g
    g.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_whatever_the_worker_does_the_answer_is_well_formed_and_the_charge_bounded(gateway, fake, stream):
    # each request may use a prompt of ~300 tokens (its bytes and a template's) and 8 answer tokens at most
    run_harness(gateway, fake, Mode, {**ASK, "stream": stream}, CASES, lambda case: script(case, stream),
                FAILS, MID_STREAM if stream else set(), STALL, prompt_bound=400)


def test_a_lying_worker_on_one_tenant_leaves_another_tenants_bucket_alone(gateway, fake):
    """Noisy neighbours on the quotas: P's worker says 10**12 tokens, P exhausts its own bucket; Q's
    requests and Retry-After are what they were, and P's own Retry-After stays bounded."""
    p = create_key(gateway.home, "--tenant", "p", "--tpm", "300")
    q = create_key(gateway.home, "--tenant", "q", "--tpm", "300")
    fake.mode = Mode(script=[json.dumps(honest_body(usage_=usage(10**12, 10**12)))])
    assert post(gateway.url, p, ASK).status_code == 200
    fake.mode = Mode()
    refused = None
    for _ in range(40):  # P spends its own bucket down
        r = post(gateway.url, p, {**ASK, "temperature": 0.5})
        if r.status_code == 429:
            refused = r
            break
    assert refused is not None and 0 < float(refused.headers["retry-after"]) <= 120, refused
    for _ in range(3):
        assert post(gateway.url, q, {**ASK, "temperature": 0.5}).status_code == 200


def test_an_answer_without_usage_is_a_completed_answer(gateway, fake):
    """Item 5: cached (the same greedy request again is a hit), counted ok (not 499), and charged
    by its answer's length, not the prompt's characters / 4 + 1."""
    key = create_key(gateway.home, "--tenant", "no-usage")
    fake.mode = Mode(script=[json.dumps(honest_body(text="word " * 80, usage_="missing"))])
    ask = {**ASK, "max_tokens": 200}
    first = post(gateway.url, key, ask)
    assert first.status_code == 200 and first.headers["x-cascade-cache"] == "miss", first.text[:300]
    fake.mode = Mode()
    second = post(gateway.url, key, ask)
    assert second.status_code == 200 and second.headers["x-cascade-cache"] == "hit"
    assert second.json()["choices"][0]["message"]["content"] == "word " * 80
    outcomes = {dict(k)["outcome"]: v for k, v in samples(gateway.url, "cascade_gateway_requests_total",
                                                          tenant="no-usage").items() if v}
    assert outcomes == {"ok": 1, "cache_hit": 1}
    assert total(gateway.url, "cascade_gateway_completion_tokens_total", tenant="no-usage") >= 80  # 400 characters


def test_the_next_honest_request_through_the_official_client_succeeds(gateway, fake):
    c = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=new_key(gateway.url, gateway.admin), max_retries=0,
                      timeout=10)
    whole = c.chat.completions.create(**ASK)
    assert whole.choices[0].message.content and whole.usage.completion_tokens == 3
    chunks = list(c.chat.completions.create(**{**ASK, "temperature": 0.3}, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Red, blue"


@pytest.fixture(scope="module")
def patient(tmp_path_factory, fake):
    """A gateway with the default timeouts (60 s to the first chunk, 600 s for an answer)."""
    g = start_gateway(tmp_path_factory.mktemp("hostile-patient"), fake, retries=0)
    yield g
    g.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("stage", ["before_headers", "mid_stream"])
def test_x_cascade_deadline_is_kept_against_a_stalled_worker(patient, fake, stream, stage):
    """Item 7: the deadline bounds the wait (0.5 s and its grace), and the worker is told it."""
    chunks = sse(*honest_chunks(), "[DONE]")
    whole = chunks if stream else [json.dumps(honest_body())]
    fake.mode = (Mode(stall_s=4.0, script=whole) if stage == "before_headers"
                 else Mode(script=[chunks[0], 4.0, *chunks[1:]] if stream else ['{"id":', 4.0, '"x"}']))
    t0 = time.monotonic()
    r = post(patient.url, patient.admin, {**ASK, "stream": stream}, x_cascade_deadline="0.5")
    assert time.monotonic() - t0 < 2.5
    status, kind, err = well_formed(r, stream)
    assert kind == "error" and err["code"] == "deadline_exceeded", (status, err)
    assert status == (200 if stream and stage == "mid_stream" else 504)
    assert 0 < float(fake.headers[-1]["x-cascade-deadline"]) <= 0.5
