"""The OpenAPI documents of the edge agent, a cloud worker and the gateway declare the request
bodies and the error responses; schemathesis, fuzzing each live server from its own document,
gets no server error and no response (status, media type, body) that the document does not describe."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests import loopback
from tests.conftest import create_key

MODEL = "smollm2-135m"
MAX_TOKENS = 4  # every generation the fuzz starts stays this short
# per operation; in `make test` the examples are the same every run (a fuzz that finds something
# new fails a later, unrelated change): CASCADE_FUZZ_EXAMPLES=500 CASCADE_FUZZ_RANDOM=1 to dig deeper
EXAMPLES = int(os.environ.get("CASCADE_FUZZ_EXAMPLES", "15"))
RANDOM = os.environ.get("CASCADE_FUZZ_RANDOM") == "1"
CONFORMANCE = [status_code_conformance, content_type_conformance, response_schema_conformance,
               response_headers_conformance]
# 5xx that are a designed answer, not a failure: the edge agent has no cloud to escalate to here
# (`cascade.offline: "fail"` is a 503), and the internal API was given a bogus prefill_url
DESIGNED_5XX = {("edge", "POST /v1/chat/completions"): {503}, ("edge", "POST /v1/completions"): {503},
                ("edge", "POST /v1/embeddings"): {503},  # `cascade.mode` "cloud" with no cloud configured
                ("worker", "POST /internal/generate"): {502, 503}}
# what each server's generation endpoints can answer besides 200 (the worker has no queue to be full)
ERRORS = {"edge": {"400", "401", "404", "413", "429", "503"},
          "worker": {"400", "401", "404", "413", "503"},
          "gateway": {"400", "401", "403", "404", "413", "429", "502", "503"}}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def worker(cloud_worker):
    return cloud_worker


@pytest.fixture(scope="module", params=list(ERRORS))
def target(request, engine_home) -> tuple[str, str, dict[str, str]]:
    """One live server: its name, its URL and the headers a request to it needs."""
    if request.param == "edge":
        return "edge", request.getfixturevalue("agent").url, {}
    if request.param == "worker":
        return "worker", request.getfixturevalue("worker").url, {}
    key = create_key(engine_home, "--tenant", "fuzz")
    return "gateway", request.getfixturevalue("cloud_both").url, {"Authorization": f"Bearer {key}"}


def _schema(doc: dict, schema: dict) -> dict:
    ref = schema.get("$ref", "")
    return doc["components"]["schemas"][ref.rsplit("/", 1)[-1]] if ref else schema


def test_the_document_declares_the_bodies_and_the_errors(target):
    name, url, _ = target
    doc = loopback.get(f"{url}/openapi.json", timeout=30).json()
    for path, field in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["required"]
        body = _schema(doc, op["requestBody"]["content"]["application/json"]["schema"])
        assert {field, "model"} <= set(body["required"]) and {field, "model", "max_tokens"} <= set(body["properties"])
        assert ERRORS[name] <= set(op["responses"])
        for status in ERRORS[name]:
            error = _schema(doc, op["responses"][status]["content"]["application/json"]["schema"])
            assert {"message", "type"} <= set(_schema(doc, error["properties"]["error"])["required"])
        ok = op["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(ok)
        assert _schema(doc, ok["application/json"]["schema"])["properties"]["choices"]
        if name == "edge":  # queued for the cloud
            queued = op["responses"]["202"]["content"]["application/json"]["schema"]
            assert "location" in _schema(doc, queued)["properties"]
    assert "HTTPValidationError" not in str(doc)  # validation failures are 400s with the error body


def _cheap(body: dict) -> None:
    """Point a generated generation request at the served model, unstreamed and a few tokens long."""
    if "messages" not in body and "prompt" not in body:
        return
    body["model"] = MODEL
    body["stream"] = False
    for field in ("max_tokens", "max_completion_tokens"):
        v = body.get(field)
        small = isinstance(v, int | float) and not isinstance(v, bool) and v <= MAX_TOKENS
        if not small and (field == "max_tokens" or v is not None):
            body[field] = MAX_TOKENS


def _fuzz(name: str, operation, headers: dict[str, str], statuses: list[int]) -> None:
    """``EXAMPLES`` requests to ``operation`` of server ``name``, of positive and negative data,
    their statuses appended to ``statuses``; raises at the first failure: a 5xx that is not a
    designed answer, or a response that the document does not describe."""
    designed = DESIGNED_5XX.get((name, operation.label), set())

    @given(case=st.one_of([operation.as_strategy(mode) for mode in GenerationMode]))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate], derandomize=not RANDOM,
              suppress_health_check=list(HealthCheck))
    def run(case):
        if isinstance(case.body, dict):
            _cheap(case.body)
        r = case.call_and_validate(headers=headers, checks=CONFORMANCE, timeout=60)  # a hang fails it
        statuses.append(r.status_code)
        if r.status_code >= 500 and r.status_code not in designed:
            raise AssertionError(f"{r.status_code} {r.text}\n{case.as_curl_command(headers)}")

    run()


def test_fuzzing_finds_no_server_error_and_no_undocumented_response(target):
    """Every operation of the server's document (what schemathesis's ``parametrize`` does, but
    its lazy fixture loader does not run on our pytest)."""
    name, url, headers = target
    config = SchemathesisConfig.from_dict({"output": {"sanitization": {"enabled": False}}})  # token ids are not secrets
    api = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)
    failures, statuses = [], {}
    for result in api.get_all_operations():
        operation = result.ok()
        statuses[operation.label] = []
        try:
            _fuzz(name, operation, headers, statuses[operation.label])
        except (Exception, FailureGroup) as e:  # one operation's failure does not hide the next one's
            failures.append(f"{name} {operation.label}: {e}")
    assert not failures, "\n\n".join(failures)
    generated = statuses["POST /v1/chat/completions"] + statuses["POST /v1/completions"]
    assert 200 in generated, f"no fuzzed request reached the model: {sorted(generated)}"
