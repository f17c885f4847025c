"""`cascade cloud worker --role both` through the official `openai` client."""

import sys

import openai
import pytest

from cloud_tier.engine import SamplingParams
from tests import loopback

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "Which city is the capital of France?"}]


@pytest.fixture(scope="module")
def worker(cloud_worker):
    return cloud_worker


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_streaming_and_not_agree(client):
    r = client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert r.headers["x-cascade-tier"] == "cloud"
    full = r.parse()
    assert full.choices[0].message.content.strip() and full.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_greedy_output_equals_the_engine_alone(client, smollm2_engine):
    prompt = "The history of the printing press"
    served = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
    alone = smollm2_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert served.choices[0].text == alone.text
    assert served.usage.completion_tokens == len(alone.token_ids)


def test_completion_stream_with_logprobs_and_stop(client):
    parts = list(client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=16, temperature=0,
                                           stop=["6"], logprobs=2, stream=True))
    text = "".join(p.choices[0].text for p in parts if p.choices)
    assert text.strip().startswith("4") and "6" not in text
    assert parts[-1].choices[0].finish_reason == "stop"
    assert any(p.choices and p.choices[0].logprobs and p.choices[0].logprobs.top_logprobs for p in parts)


def test_errors_are_openai_shaped(worker, client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="word " * 2000, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    r = loopback.post(f"{worker.url}/v1/chat/completions", content=b"{nope",
                      headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_health_and_metrics(worker, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    health = loopback.get(f"{worker.url}/healthz").json()
    assert health["tier"] == "cloud" and health["engine"]["kv_blocks_total"] > 0
    text = loopback.get(f"{worker.url}/metrics").text
    for name in ("cascade_worker_kv_blocks_total", "cascade_worker_prefix_cache_hits_tokens",
                 "cascade_worker_generation_tokens_total", "cascade_worker_time_to_first_token_seconds_bucket"):
        assert name in text


# A gateway-only host: `cascade cloud serve --workers URL` with torch impossible to import.
NO_TORCH = ("import sys; sys.modules['torch'] = None; sys.modules['cloud_tier.engine'] = None; "
            "from cascade_cli.main import main; sys.exit(main())")


def test_a_gateway_without_torch_serves_in_front_of_a_worker(worker, tmp_path):
    from cascade.processes import free_port, spawn, stop, wait_healthy
    from tests.conftest import create_key

    port = free_port()
    log = tmp_path / "gateway.log"
    gateway = spawn([sys.executable, "-c", NO_TORCH, "--log-level", "WARNING", "cloud", "serve", "--workers",
                     worker.url, "--port", str(port)], env={"CASCADE_HOME": str(tmp_path)}, log=log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, gateway, 120, "gateway without torch", log=log)
        key = create_key(tmp_path, "--tenant", "no-torch")
        via_gateway = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
        direct = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=120)
        # the model's names and context come from the worker, not from a model on this host
        assert [m.id for m in via_gateway.models.list().data] == [MODEL]
        args = dict(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
        got = via_gateway.chat.completions.create(**args)
        want = direct.chat.completions.create(**args)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.prompt_tokens == want.usage.prompt_tokens  # the same tokenizer, taken from the worker
        assert loopback.get(f"{url}/healthz").json()["workers"][worker.url]["healthy"] is True
    finally:
        stop(gateway)
    assert "Traceback" not in log.read_text()


def test_a_prefill_without_a_request_id_frees_its_kv(worker):
    """The engine names a request that came without an id; the prefill side must free the KV it
    held under that name (it once looked it up under "" and leaked a block, with a 500)."""
    free = loopback.get(f"{worker.url}/internal/load").json()["kv_blocks_free"]
    body = {"kv_target": "127.0.0.1:1", "record": {"prompt_token_ids": [3, 4, 5], "request_id": "",
                                                   "sampling": {"max_tokens": 4, "temperature": 0}}}
    r = loopback.post(f"{worker.url}/internal/prefill", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["ok"] is False and r.json()["code"] == "transfer_failed"  # nobody listens at the target
    assert loopback.get(f"{worker.url}/internal/load").json()["kv_blocks_free"] == free


@pytest.mark.parametrize("extra", [{"priority": True}, {"priority": 1e300}, {"priority": 2**40}, {"priority": "1"},
                                   {"stop_token_ids": ["a"]}, {"stop_token_ids": [-1]}, {"stop_token_ids": 7},
                                   {"ignore_eos": "false"}])
def test_the_engines_extra_fields_are_checked_when_the_worker_is_called_directly(worker, extra):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **extra}
    r = loopback.post(f"{worker.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra)), r.text



def _generate(worker, prompt_ids: list[int], sampling: dict):
    record = {"request_id": "", "prompt_token_ids": prompt_ids, "sampling": sampling}
    return loopback.post(f"{worker.url}/internal/generate", json={"record": record}, timeout=120)


def test_a_guided_request_answers_within_its_grammar_and_an_uncompilable_one_is_a_400(worker, smollm2_engine):
    import json

    from llguidance import LLMatcher

    from tests.integration.worker_checks import total

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}, "stars": {"type": "integer",
              "minimum": 1, "maximum": 5}}, "required": ["city", "stars"], "additionalProperties": False}
    grammar = LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    prompt = smollm2_engine.tokenizer.encode("Rate the capital of France as JSON:")
    before = total(worker.url, "cascade_worker_guided_requests_total")
    r = _generate(worker, prompt, {"max_tokens": 40, "temperature": 0, "guided": grammar})
    assert r.status_code == 200, r.text
    events = [json.loads(line) for line in r.text.splitlines()]
    answer = json.loads("".join(e["token"][1] for e in events if "token" in e))
    assert answer["city"] in ("Paris", "Lyon") and 1 <= answer["stars"] <= 5
    assert events[-1]["finish"][0] == "stop"
    assert total(worker.url, "cascade_worker_guided_requests_total") == before + 1
    assert total(worker.url, "cascade_worker_grammar_compiles") >= 1
    bad = _generate(worker, prompt, {"max_tokens": 4, "guided": "start: missing_rule"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_schema", bad.text


def test_response_format_json_schema_through_the_workers_own_chat_completions(client):
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"enum": ["France", "Spain", "Italy"]},
                                               "landmarks": {"type": "array", "items": {"type": "string",
                                                                                        "maxLength": 20},
                                                             "minItems": 1, "maxItems": 2}},
              "required": ["city", "country", "landmarks"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=80, temperature=0,
                                       response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=80, temperature=0,
                                            response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
