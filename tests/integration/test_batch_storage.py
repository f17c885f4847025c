"""The Batch API's storage and its lock under a noisy tenant, on the real gateway in process in
front of a model-free worker (tests/integration/batch_fakes.py), through the official client: a
batch's stored lines count against its tenant's storage cap and are freed once its files are
written (the database gives the space back); a tenant has a bounded number of batches not yet
ended; and while one tenant's large batch is validated and stored, another tenant's requests
answer at once."""

from __future__ import annotations

import asyncio
import io
import json
import sqlite3
import threading
import time

import httpx
import openai
import pytest

from cloud_tier.gateway.pipeline.stores import batch_db_path
from tests.integration.batch_fakes import MODEL, FakeOpenAIWorker, InProcessGateway

CHAT = "/v1/chat/completions"


@pytest.fixture
def worker():
    w = FakeOpenAIWorker().start()
    yield w
    w.stop()


def jsonl(prefix: str, n: int, pad: int = 0) -> bytes:
    return "".join(json.dumps({"custom_id": f"{prefix}{i}", "method": "POST", "url": CHAT, "body": {
        "model": MODEL, "messages": [{"role": "user", "content": f"{prefix}{i} " + "x" * pad}], "max_tokens": 4}})
        + "\n" for i in range(n)).encode()


def client(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=30)


def wait_for(c: openai.OpenAI, batch_id: str, done, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while True:
        b = c.batches.retrieve(batch_id)
        if done(b):
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}: {b.request_counts}"
        time.sleep(0.05)


def db_bytes(gateway) -> int:
    path = batch_db_path(gateway.config.gateway)
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())


def stored_lines(gateway) -> int:
    conn = sqlite3.connect(batch_db_path(gateway.config.gateway))
    try:
        return conn.execute("SELECT COUNT(*) FROM batch_lines").fetchone()[0]
    finally:
        conn.close()


def batch_status(gateway, batch_id: str) -> str:
    conn = sqlite3.connect(batch_db_path(gateway.config.gateway))
    try:
        return conn.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()[0]
    finally:
        conn.close()


def test_creating_and_cancelling_batches_from_one_file_keeps_stored_bytes_and_the_database_bounded(tmp_path, worker):
    async def slow(body):
        await asyncio.sleep(0.2)  # the lines in flight at the cancel finish a little later

    worker.hook = slow
    g = InProcessGateway(tmp_path, worker.url, batch_concurrency=1).start()
    try:
        c = client(g, g.key("p"))
        content = jsonl("p", 3000, pad=900)  # 3 MB, 3,000 lines
        file_id = c.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch").id
        for _ in range(4):
            b = c.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
            wait_for(c, b.id, lambda b: b.status != "validating")
            c.batches.cancel(b.id)
            b = wait_for(c, b.id, lambda b: b.status == "cancelled")
            assert b.request_counts.total == 3000 == b.request_counts.completed + b.request_counts.failed
        files = sum(f.bytes for f in c.files.list().data)  # the input and each batch's output and error files
        assert stored_lines(g) == 0  # a finished batch's lines are in its files, not held twice
        assert g.app.state.batches.used_bytes("p") == files  # what the tenant's cap counts: all it stores
        assert db_bytes(g) < files + (4 << 20), f"{db_bytes(g)} bytes on disk for {files} bytes of files"
    finally:
        g.stop()


def test_a_tenant_past_its_batch_caps_is_refused_and_another_tenant_is_not(tmp_path, worker):
    async def stall_p(body):
        if body["messages"][0]["content"].startswith("p"):
            await asyncio.sleep(5)  # p's batches stay in progress

    worker.hook = stall_p
    g = InProcessGateway(tmp_path, worker.url, batch_tenant_max_active=2, batch_tenant_max_bytes=1 << 20,
                         batch_concurrency=8).start()  # p's 4 stalled lines leave q room
    try:
        p, q, r = (client(g, g.key(t)) for t in "pqr")
        small = p.files.create(file=("in.jsonl", io.BytesIO(jsonl("p", 2))), purpose="batch").id
        for _ in range(2):
            p.batches.create(input_file_id=small, endpoint=CHAT, completion_window="24h")
        with pytest.raises(openai.APIStatusError) as e:
            p.batches.create(input_file_id=small, endpoint=CHAT, completion_window="24h")
        assert e.value.status_code == 429 and e.value.body["code"] == "too_many_active_batches"
        # a batch's lines are stored too: r's 700 kB file fits its 1 MiB, the file and its lines do not
        big = r.files.create(file=("in.jsonl", io.BytesIO(jsonl("r", 700, pad=900))), purpose="batch").id
        with pytest.raises(openai.APIStatusError) as e:
            r.batches.create(input_file_id=big, endpoint=CHAT, completion_window="24h")
        assert e.value.status_code == 403 and e.value.body["code"] == "storage_limit_exceeded"
        assert set(e.value.body) == {"message", "type", "param", "code"}
        started = time.monotonic()  # q is unaffected by either
        mine = q.files.create(file=("in.jsonl", io.BytesIO(jsonl("q", 3))), purpose="batch").id
        b = q.batches.create(input_file_id=mine, endpoint=CHAT, completion_window="24h")
        b = wait_for(q, b.id, lambda b: b.status == "completed", timeout_s=10)
        assert b.request_counts.completed == 3 and time.monotonic() - started < 5
    finally:
        g.stop()


def test_while_a_large_batch_is_stored_another_tenants_requests_answer_at_once(tmp_path, worker):
    g = InProcessGateway(tmp_path, worker.url, batch_concurrency=1).start()
    try:
        p, q_key = client(g, g.key("p")), g.key("q")
        store = g.app.state.batches
        file_id = store.add_file("p", "batch", "in.jsonl", jsonl("p", 30_000, pad=60))["id"]  # 6 MB
        b = p.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
        waits, stop = [], threading.Event()

        def probe():  # another tenant's listing and the health check, one after another
            with httpx.Client(base_url=g.url, headers={"authorization": f"Bearer {q_key}"}, timeout=30) as http:
                while not stop.is_set():
                    for path in ("/v1/files", "/healthz"):
                        started = time.monotonic()
                        assert http.get(path).status_code == 200
                        waits.append(time.monotonic() - started)
                    time.sleep(0.01)

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            while batch_status(g, b.id) == "validating":  # read beside the store, never waiting for its lock
                time.sleep(0.05)
        finally:
            stop.set()
            prober.join(30)
        assert len(waits) > 10 and max(waits) < 0.5, f"{len(waits)} requests, the slowest {max(waits):.2f} s"
        p.batches.cancel(b.id)
    finally:
        g.stop()
