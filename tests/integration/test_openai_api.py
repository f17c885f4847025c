"""The edge agent through the official `openai` client, as an app would use it."""

import openai
import pytest

from tests import loopback

MODEL = "smollm2-135m"
HELLO = [{"role": "user", "content": "Which city is the capital of France?"}]


def test_models_and_health(agent, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = loopback.get(f"{agent.url}/healthz").json()
    assert health["status"] == "ok" and health["slots"]["total"] == 2
    assert loopback.get(f"{agent.url}/health").status_code == 200
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


def test_chat_completion(client):
    r = client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=24,
                                                         temperature=0)
    assert r.headers["x-cascade-tier"] == "edge"
    c = r.parse()
    assert c.object == "chat.completion" and c.model == MODEL
    # no assertion on the wording (it changes with the CPU's instruction set): greedy is
    # deterministic on one machine, so the same request gives the same answer
    assert c.choices[0].message.content.strip()
    again = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0)
    assert again.choices[0].message.content == c.choices[0].message.content
    assert c.choices[0].finish_reason in ("stop", "length")
    assert c.usage.prompt_tokens > 5 and 0 < c.usage.completion_tokens <= 24
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens


def test_chat_stream_equals_the_non_streamed_answer(client):
    full = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=32, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=32, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completion_and_its_stream(client):
    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                  temperature=0)
    assert c.object == "text_completion" and c.choices[0].text
    assert c.usage.completion_tokens <= 12
    parts = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                           temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == c.choices[0].text


def test_completion_accepts_token_ids(client):
    by_text = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=8, temperature=0)
    ids = client.completions.create(model=MODEL, prompt=[1, 19556, 28, 957, 1462, 314], max_tokens=8,
                                    temperature=0)
    assert ids.usage.prompt_tokens == 6 and ids.choices[0].text
    assert by_text.choices[0].text


def test_chat_logprobs_and_top_logprobs(client):
    c = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        assert tok.top_logprobs[0].token == tok.token  # greedy picks the most likely
    assert "".join(t.token for t in content) == c.choices[0].message.content


def test_streamed_logprobs(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 6 or chunks[-1].choices[0].finish_reason == "stop"
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_completion_legacy_logprobs(client):
    c = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(d) <= 2 for d in lp.top_logprobs)


def test_stop_sequences(client):
    full = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=16, temperature=0)
    text = full.choices[0].text
    assert "5" in text
    cut = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=16, temperature=0,
                                    stop=["5"])
    assert cut.choices[0].text == text[:text.index("5")]
    assert cut.choices[0].finish_reason == "stop"


def test_seed_reproducible_at_temperature(client):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a joke."}],
                                              max_tokens=20, temperature=1.0, seed=seed).choices[0].message.content
    assert sample(7) == sample(7)
    assert len({sample(1), sample(2), sample(3)}) > 1


def test_greedy_is_deterministic(client):
    outs = {client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24,
                                           temperature=0).choices[0].message.content for _ in range(3)}
    assert len(outs) == 1


def test_max_tokens_gives_length(client):
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write an essay."}],
                                       max_tokens=3, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 3


def test_metrics_count_requests_and_tokens(agent, client):
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0)
    text = loopback.get(f"{agent.url}/metrics").text
    for name in ("cascade_edge_requests_total", "cascade_edge_generation_tokens_total",
                 "cascade_edge_queue_waiting", "cascade_edge_time_to_first_token_seconds_bucket",
                 "cascade_edge_inter_token_latency_seconds_bucket"):
        assert name in text
    line = next(ln for ln in text.splitlines() if ln.startswith("cascade_edge_generation_tokens_total"))
    assert float(line.split()[-1]) > 0


def test_unknown_model_is_404_through_the_client(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=HELLO)
    assert e.value.body["code"] == "model_not_found"
