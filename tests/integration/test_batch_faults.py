"""The Batch API under faults and a noisy neighbour, on the real gateway in process in front of a
model-free worker that injects the faults (tests/integration/batch_fakes.py), through the
official client: a cancelled batch reports every line once, whatever its lines were doing; one
tenant's refused lines neither starve another tenant's nor retry forever."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time

import openai
import pytest

from cloud_tier.gateway.tenants.budgets import period_of
from cloud_tier.gateway.tenants.keys_sqlite import KeyStore
from tests.integration.batch_fakes import MODEL, FakeOpenAIWorker, InProcessGateway, refuse

CHAT = "/v1/chat/completions"


@pytest.fixture
def worker():
    w = FakeOpenAIWorker().start()
    yield w
    w.stop()


def chat_line(cid: str, content: str | None = None) -> dict:
    return {"custom_id": cid, "method": "POST", "url": CHAT,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content or cid}], "max_tokens": 4}}


def client(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=30)


def submit(c: openai.OpenAI, lines: list[dict]):
    text = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines)
    file_id = c.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch").id
    return c.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")


def wait_for(c: openai.OpenAI, batch_id: str, done, timeout_s: float = 20):
    deadline = time.monotonic() + timeout_s
    while True:
        b = c.batches.retrieve(batch_id)
        if done(b):
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}: {b.request_counts}"
        time.sleep(0.05)


def files_of(c: openai.OpenAI, b) -> tuple[list[dict], list[dict]]:
    def read(file_id):
        return [] if file_id is None else [json.loads(x) for x in c.files.content(file_id).content.split(b"\n") if x]
    return read(b.output_file_id), read(b.error_file_id)


def test_a_line_refused_while_its_batch_cancels_ends_as_cancelled_and_no_line_is_lost(tmp_path, worker):
    """Eight lines, four in flight and held by the worker; the batch is cancelled; then the worker
    answers the first with a retryable 503 and the others with 200. Every line ends in exactly
    one file: three answers, five cancelled (the refused one among them)."""
    release = threading.Event()

    async def hold(body):
        await asyncio.to_thread(release.wait, 20)
        if body["messages"][0]["content"] == "l0":
            return await refuse(503, "overloaded")
        return None

    worker.hook = hold
    g = InProcessGateway(tmp_path, worker.url).start()
    try:
        c = client(g, g.key("acme"))
        lines = [chat_line(f"l{i}") for i in range(8)]
        batch = submit(c, lines)
        wait_for(c, batch.id, lambda b: len(worker.bodies) >= 4)
        assert c.batches.cancel(batch.id).status == "cancelling"
        release.set()
        done = wait_for(c, batch.id, lambda b: b.status == "cancelled")
        out, errs = files_of(c, done)
        assert sorted(x["custom_id"] for x in out + errs) == sorted(ln["custom_id"] for ln in lines)
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 3, 5)
        cancelled = {f"l{i}": "batch_cancelled" for i in (0, 4, 5, 6, 7)}
        assert {e["custom_id"]: e["error"]["code"] for e in errs} == cancelled
        assert {b["messages"][0]["content"] for b in worker.bodies} == {"l0", "l1", "l2", "l3"}  # none ran again
    finally:
        g.stop()


def test_one_tenants_refused_batch_neither_starves_another_tenant_nor_retries_forever(tmp_path, worker):
    """Tenant P's budget is spent: every line of its batch (submitted first, as many lines as the
    runner has slots) is refused 429 budget_exceeded. Tenant Q's three lines, submitted after,
    are all answered within 3 s; P's lines end in the error file with that refusal after
    ``batch_max_refusals`` tries each."""
    g = InProcessGateway(tmp_path, worker.url, batch_concurrency=4, batch_max_refusals=3, batch_backoff_s=0.2,
                         batch_backoff_max_s=0.4).start()
    try:
        keys = KeyStore(tmp_path / "gateway.db")
        p_key, q_key = g.key("p"), g.key("q")
        keys.set_budget("tenant", "p", tokens=10)
        keys.add_spend([("tenant", "p", period_of("month", time.time())[0], 10.0, 0.0, 0.0)])
        keys.close()
        p, q = client(g, p_key), client(g, q_key)
        p_batch = submit(p, [chat_line(f"p{i}") for i in range(4)])
        wait_for(p, p_batch.id, lambda b: b.status == "in_progress")
        time.sleep(0.3)  # P's lines have been refused at least once
        started = time.monotonic()
        q_batch = submit(q, [chat_line(f"q{i}") for i in range(3)])
        q_done = wait_for(q, q_batch.id, lambda b: b.status in ("completed", "failed"), 10)
        assert q_done.status == "completed" and q_done.request_counts.completed == 3
        assert time.monotonic() - started < 3.0
        p_done = wait_for(p, p_batch.id, lambda b: b.status in ("completed", "failed"), 15)
        out, errs = files_of(p, p_done)
        assert out == [] and sorted(e["custom_id"] for e in errs) == ["p0", "p1", "p2", "p3"]
        assert {(e["response"]["status_code"], e["response"]["body"]["error"]["code"]) for e in errs} == {
            (429, "budget_exceeded")}
    finally:
        g.stop()
