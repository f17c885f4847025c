"""Uploads and stored files on the real gateway in process (tests/integration/batch_fakes.py):
bodies are bounded while they are read (a chunked upload over the limit is a 413 before the
rest is read), each tenant's files are capped and expire, and counting a large input file's
lines at ``POST /v1/batches`` holds a bounded amount of memory whatever the file's size."""

from __future__ import annotations

import io
import time
import tracemalloc

import httpx
import openai
import pytest

from tests.integration.batch_fakes import FakeOpenAIWorker, InProcessGateway

CHAT = "/v1/chat/completions"
LIMIT = 1 << 20


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    w = FakeOpenAIWorker().start()
    g = InProcessGateway(tmp_path_factory.mktemp("uploads"), w.url, batch_max_file_bytes=LIMIT,
                         batch_max_lines=1000, batch_tenant_max_files=3, batch_tenant_max_bytes=16 << 20).start()
    yield g
    g.stop()
    w.stop()


def client(gateway, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=60)


def chunked_post(url: str, key: str, head: bytes, total: int, tail: bytes = b"", content_type: str = ""):
    """POST ``head`` + ``total`` bytes + ``tail`` chunked; (response, bytes the client got to send)."""
    sent = [0]

    def body():
        yield head
        piece = b"x" * (64 << 10)
        while sent[0] < total:
            sent[0] += len(piece)
            yield piece
        yield tail

    headers = {"authorization": f"Bearer {key}", **({"content-type": content_type} if content_type else {})}
    with httpx.Client(timeout=60) as http:
        r = http.post(url, content=body(), headers=headers)
    return r, sent[0]


def test_a_chunked_upload_over_the_limit_is_refused_before_the_rest_is_read(gateway):
    key = gateway.key("big")
    boundary = "b0undary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{boundary}\r\n"
            "Content-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode()
    r, sent = chunked_post(f"{gateway.url}/v1/files", key, head, 64 << 20, f"\r\n--{boundary}--\r\n".encode(),
                           f"multipart/form-data; boundary={boundary}")
    assert r.status_code == 413 and r.json()["error"]["code"] in ("file_too_large", "request_too_large")
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert sent < 24 << 20  # refused once past the limit (loopback buffers aside), never the 64 MiB read
    # every other route is bounded too (max_body_bytes, 4 MiB by default)
    r, sent = chunked_post(f"{gateway.url}/v1/chat/completions", key, b'{"model": "', 64 << 20, b'"}',
                           "application/json")
    assert r.status_code == 413 and sent < 24 << 20
    assert client(gateway, key).files.list().data == []  # nothing was stored


def test_a_tenant_at_its_storage_cap_never_stops_another_tenant_uploading(gateway):
    p, q = client(gateway, gateway.key("p")), client(gateway, gateway.key("q"))
    for i in range(3):  # batch_tenant_max_files = 3
        p.files.create(file=(f"{i}.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    with pytest.raises(openai.APIStatusError) as e:
        p.files.create(file=("more.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    assert e.value.status_code in (400, 403, 413, 429) and e.value.body["code"] == "storage_limit_exceeded"
    started = time.monotonic()
    made = q.files.create(file=("q.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    assert q.files.retrieve(made.id).bytes == 3 and time.monotonic() - started < 2.0
    p.files.delete(p.files.list().data[0].id)  # room again
    p.files.create(file=("again.jsonl", io.BytesIO(b"{}\n")), purpose="batch")


def test_a_file_expires_as_asked_and_by_default(gateway):
    c = client(gateway, gateway.key("expiry"))
    kept = c.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="batch",
                          expires_after={"anchor": "created_at", "seconds": 3600})
    assert kept.expires_at == kept.created_at + 3600
    default = c.files.create(file=("b.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    assert default.expires_at == default.created_at + 30 * 86400  # batch_file_ttl_s
    store = gateway.app.state.batches
    store.clock = lambda: time.time() + 3601
    try:
        with pytest.raises(openai.NotFoundError):
            c.files.retrieve(kept.id)
        assert store.sweep_expired() == 1
        assert [f.id for f in c.files.list().data] == [default.id]
    finally:
        store.clock = time.time


def test_counting_a_large_files_lines_holds_a_bounded_amount_of_memory(gateway):
    c = client(gateway, gateway.key("counting"))
    line = b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    content = line * (8_000_000 // len(line))  # 8 MB, 100,000 lines: over batch_max_lines (1000)
    store = gateway.app.state.batches
    file_id = store.add_file("counting", "batch", "big.jsonl", content)["id"]  # past the upload limit
    del content
    tracemalloc.start()
    try:
        with pytest.raises(openai.BadRequestError) as e:
            c.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert e.value.body["code"] == "too_many_requests" and "100000" in e.value.body["message"]
    assert peak < 2 << 20, f"{peak} bytes at peak to count an 8 MB file's lines"

