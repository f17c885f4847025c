"""Two gateway replicas (`cascade cloud serve --workers <one real cascade worker>`) on one real
PostgreSQL (--db) and one real Redis (--redis), through the official openai client: a key made
with `cascade cloud keys create --db postgresql://...` works on both and its revocation with
`cascade cloud keys revoke` reaches both within about a second; a tenant's rps quota is the
limit across both; an Idempotency-Key replayed on the other replica gets the stored answer,
uncharged; a cache hit on one is a hit on the other; a budget set with the CLI is spent on one
and enforced on the other. Each test has a tenant of its own."""

from __future__ import annotations

import json
import os
import subprocess
import time

import openai
import pytest

from cascade_cli.spawn import cascade_command
from tests.conftest import REPO, Server, create_key, gateway_count
from tests.pg_redis import fresh_database

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def state(postgres_dsn, redis_url):
    return fresh_database(postgres_dsn), redis_url


@pytest.fixture(scope="module")
def replicas(engine_home, cloud_worker, state):
    dsn, redis = state
    a, b = (Server(engine_home, ["cloud", "serve"], "--workers", cloud_worker.url, "--db", dsn, "--redis", redis)
            for _ in range(2))
    try:
        yield a.wait_healthy(300), b.wait_healthy(300)
    finally:
        a.stop()
        b.stop()


def keys(home, state, *args: str) -> subprocess.CompletedProcess:
    """`cascade cloud keys ARGS --db <the replicas' PostgreSQL> --redis <their Redis>`."""
    dsn, redis = state
    return subprocess.run(cascade_command("cloud", "keys", *args, "--db", dsn, "--redis", redis, log_level=None),
                          env={**os.environ, "CASCADE_HOME": str(home)}, cwd=REPO, capture_output=True, text=True,
                          check=True)


def new_key(home, state, tenant: str, *args: str) -> str:
    return create_key(home, "--tenant", tenant, "--db", state[0], *args)


def spent(home, state, tenant: str) -> float:
    """The tenant's tokens this period, as `cascade cloud keys list --json` shows them."""
    (listed,) = json.loads(keys(home, state, "list", "--json", "--tenant", tenant).stdout)
    return listed["tenant_spent"]["tokens"]


def client(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=120)


def ask(content: str, **kwargs) -> dict:
    return dict(model=MODEL, messages=[{"role": "user", "content": content}], **{"max_tokens": 4, **kwargs})


def test_one_key_works_on_both_replicas_and_its_revocation_reaches_both(engine_home, replicas, state):
    key = new_key(engine_home, state, "rep-keys")
    for g in replicas:
        r = client(g, key).chat.completions.create(**ask("Say hi."))
        assert r.choices[0].message.content is not None and r.usage.completion_tokens >= 1
    for g in replicas:  # cached on both now (for minutes: each replica listens for changes)
        client(g, key).models.list()
    keys(engine_home, state, "revoke", key.split("-")[1])
    # the revocation is pushed to every replica (NOTIFY): refused within about a second, not a cache TTL
    deadline = time.monotonic() + 1.5
    for g in replicas:
        while True:
            try:
                client(g, key).models.list()
            except openai.AuthenticationError:
                break
            assert time.monotonic() < deadline, f"{g.url} still takes a revoked key"
            time.sleep(0.05)


def test_a_tenant_rps_quota_holds_across_both_replicas(engine_home, replicas, state):
    a, b = replicas
    key = new_key(engine_home, state, "rep-quota", "--tenant-rps", "0.2")  # one request, then one per 5 s
    client(a, key).chat.completions.create(**ask("Name a fruit.", max_tokens=1))
    with pytest.raises(openai.RateLimitError) as e:
        client(b, key).chat.completions.create(**ask("Name a fruit.", max_tokens=1))
    assert e.value.body["code"] == "quota_rps"
    assert 1 <= int(e.value.response.headers["retry-after"]) <= 5


def test_an_idempotency_key_replayed_on_the_other_replica_is_answered_uncharged(engine_home, replicas, state):
    a, b = replicas
    key = new_key(engine_home, state, "rep-idem")
    body = ask("Write one word about the sea.", max_tokens=8, temperature=0.9)  # sampled: never a cache hit
    first = client(a, key).chat.completions.with_raw_response.create(**body, extra_headers={"Idempotency-Key": "i-1"})
    assert first.headers.get("x-cascade-idempotent-replay") is None
    charged = spent(engine_home, state, "rep-idem")
    assert charged == first.parse().usage.total_tokens
    again = client(b, key).chat.completions.with_raw_response.create(**body, extra_headers={"Idempotency-Key": "i-1"})
    assert again.headers["x-cascade-idempotent-replay"] == "true"
    answer, replayed = first.parse(), again.parse()
    assert replayed.choices[0].message.content == answer.choices[0].message.content  # sampled, yet the same
    assert replayed.usage == answer.usage
    assert spent(engine_home, state, "rep-idem") == charged  # not charged twice
    assert gateway_count(b, "rep-idem", "cascade_gateway_completion_tokens_total") == 0
    assert gateway_count(b, "rep-idem", outcome="replay") == 1


def test_a_cache_hit_on_one_replica_is_a_hit_on_the_other(engine_home, replicas, state):
    a, b = replicas
    key = new_key(engine_home, state, "rep-cache")
    body = ask("Which planet is the largest?", max_tokens=6, temperature=0)
    miss = client(a, key).chat.completions.with_raw_response.create(**body)
    assert miss.headers["x-cascade-cache"] == "miss"
    charged = spent(engine_home, state, "rep-cache")
    hit = client(b, key).chat.completions.with_raw_response.create(**body)
    assert hit.headers["x-cascade-cache"] == "hit"
    assert hit.parse().choices[0].message.content == miss.parse().choices[0].message.content
    assert spent(engine_home, state, "rep-cache") == charged  # a hit costs no tokens


def test_a_budget_set_with_the_cli_is_spent_on_one_replica_and_enforced_on_the_other(engine_home, replicas, state):
    a, b = replicas
    key = new_key(engine_home, state, "rep-budget")
    keys(engine_home, state, "budget", "--tenant", "rep-budget", "--tokens", "20", "--period", "day")
    served = client(a, key).chat.completions.create(**ask("Count to three.", max_tokens=8))
    assert served.usage.total_tokens >= 20  # the chat template alone is more: one request spends it
    with pytest.raises(openai.RateLimitError) as e:
        client(b, key).chat.completions.create(**ask("Count to four."))
    assert e.value.body["code"] == "budget_exceeded" and e.value.body["type"] == "rate_limit_error"
    assert "tenant 'rep-budget'" in e.value.body["message"] and "T00:00:00Z" in e.value.body["message"]
    assert 1 <= int(e.value.response.headers["retry-after"]) <= 86400
    assert spent(engine_home, state, "rep-budget") == served.usage.total_tokens
