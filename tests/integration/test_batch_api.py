"""The OpenAI Batch API on a real gateway (`cascade cloud serve --workers URL`) in front of the
shared real worker, through the official `openai` client: every line answered exactly once,
equal to the same request made online (greedy); bad lines in the error file; a file that is no
valid batch fails validation; files and batches are per tenant; cancel and expiry; a gateway
restarted mid-batch resumes without redoing or losing a line. The gateway reaches the worker
through ``fake_worker`` (passing everything through), which records what the engine is sent:
the priority class and the tenant."""

from __future__ import annotations

import io
import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.conftest import Server, create_key, gateway_count
from tests.integration.fake_worker import FaultyWorker

MODEL = "smollm2-135m"
CHAT = "/v1/chat/completions"
LIMITS = {"CASCADE_CLOUD_GATEWAY_BATCH_MAX_FILE_BYTES": "200000", "CASCADE_CLOUD_GATEWAY_BATCH_MAX_LINES": "40"}


@pytest.fixture(scope="module")
def worker(cloud_worker):
    w = FaultyWorker(cloud_worker.url).start()
    yield w
    w.stop()


def start_gateway(home, worker) -> Server:
    g = Server(home, ["cloud", "serve"], "--workers", worker.url, env=LIMITS).wait_healthy(180)
    g.home = home
    return g


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, worker):
    g = start_gateway(tmp_path_factory.mktemp("gateway-batch"), worker)
    yield g
    g.stop()


@pytest.fixture(scope="module")
def keys(gateway):
    return {t: create_key(gateway.home, "--tenant", t) for t in ("acme", "globex", "online")}


def client(gateway, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=60)


def chat_line(cid: str, content: str, max_tokens: int = 12) -> dict:
    return {"custom_id": cid, "method": "POST", "url": CHAT,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0}}


def upload(c: openai.OpenAI, lines: list) -> str:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    return c.files.create(file=("input.jsonl", io.BytesIO(text.encode())), purpose="batch").id


def wait_for(c: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while True:
        b = c.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}: {b.request_counts}"
        time.sleep(0.3)


def results(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in c.files.content(file_id).text.splitlines()]


QUESTIONS = ["Name a fruit.", "What is 2 + 2?", "Say hello.", "Name a planet.", "What colour is the sky?"]


def test_every_line_is_answered_once_and_equals_the_online_answer(gateway, keys, worker):
    c = client(gateway, keys["acme"])
    lines = [chat_line(f"q{i}", q) for i, q in enumerate(QUESTIONS)]
    wrong_url = {**chat_line("wrong", "Hi"), "url": "/v1/completions"}
    file_id = upload(c, [*lines[:2], "{this is not json", wrong_url, *lines[2:]])
    sent = len(worker.generate_bodies)
    batch = c.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h", metadata={"job": "t"})
    assert batch.status == "validating" and batch.metadata == {"job": "t"}
    done = wait_for(c, batch.id, {"completed", "failed"})
    assert done.status == "completed" and done.completed_at and done.in_progress_at
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 5, 2)
    out = results(c, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(ln["custom_id"] for ln in lines)  # each once
    errs = results(c, done.error_file_id)
    assert sorted((e["custom_id"] or "", e["error"]["code"]) for e in errs) == [
        ("", "invalid_json_line"), ("wrong", "invalid_url")]
    # the engine was sent the batch class and the tenant
    records = [b["record"] for b in worker.generate_bodies[sent:]]
    assert {(r["priority_class"], r["tenant"]) for r in records} == {("batch", "acme")}
    online = client(gateway, keys["online"])  # another tenant: never a hit on acme's cached results
    by_id = {o["custom_id"]: o for o in out}
    for ln in lines:
        answer = online.chat.completions.create(**ln["body"])
        got = by_id[ln["custom_id"]]["response"]
        assert got["status_code"] == 200 and got["request_id"]
        assert got["body"]["choices"][0]["message"]["content"] == answer.choices[0].message.content
        assert got["body"]["usage"]["completion_tokens"] == answer.usage.completion_tokens
    assert gateway_count(gateway, "acme", "cascade_gateway_requests_total", outcome="ok") == 5


def test_batch_lines_are_counted_by_class_and_the_class_reaches_the_worker(gateway, keys, worker):
    c = client(gateway, keys["online"])
    before = _class_count(gateway, "escalation")
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                              extra_headers={"X-Cascade-Priority": "escalation"})
    assert worker.generate_bodies[-1]["record"]["priority_class"] == "escalation"
    assert _class_count(gateway, "escalation") == before + 1
    assert _class_count(gateway, "batch") >= 5  # the batch above
    for extra in ({"extra_headers": {"X-Cascade-Priority": "urgent"}}, {"extra_body": {"priority_class": 1}}):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                      **extra)
        assert e.value.body["param"] in ("X-Cascade-Priority", "priority_class")


def _class_count(gateway, klass: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    from tests import loopback

    text = loopback.get(f"{gateway.url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "cascade_gateway_class_requests_total" and s.labels.get("priority_class") == klass)


def test_a_file_that_is_no_valid_batch_is_refused_or_fails_validation(gateway, keys):
    c = client(gateway, keys["acme"])
    dup = c.batches.create(input_file_id=upload(c, [chat_line("a", "Hi"), chat_line("a", "Ho")]), endpoint=CHAT,
                           completion_window="24h")
    failed = wait_for(c, dup.id, {"failed", "completed"}, 60)
    assert failed.status == "failed" and failed.failed_at
    assert [(e.code, e.line) for e in failed.errors.data] == [("duplicate_custom_id", 2)]
    assert failed.output_file_id is None and failed.request_counts.total == 0
    with pytest.raises(openai.BadRequestError) as e:  # over batch_max_lines (40 here)
        c.batches.create(input_file_id=upload(c, [chat_line(f"l{i}", "Hi") for i in range(41)]), endpoint=CHAT,
                         completion_window="24h")
    assert e.value.body["param"] == "input_file_id"
    with pytest.raises(openai.APIStatusError) as e:  # over batch_max_file_bytes (200 kB here)
        upload(c, [chat_line("big", "x" * 250_000)])
    assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    file_id = upload(c, [chat_line("a", "Hi")])
    for bad, param in ((dict(endpoint="/v1/embeddings"), "endpoint"), (dict(completion_window="48h"),
                                                                        "completion_window")):
        with pytest.raises(openai.BadRequestError) as e:
            c.batches.create(**{"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h", **bad})
        assert e.value.body["param"] == param
    c.files.delete(file_id)


def test_files_and_batches_belong_to_their_tenant(gateway, keys):
    acme, globex = client(gateway, keys["acme"]), client(gateway, keys["globex"])
    file_id = upload(acme, [chat_line("a", "Hi", 2)])
    batch = acme.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    for call in (lambda: globex.files.retrieve(file_id), lambda: globex.files.content(file_id),
                 lambda: globex.files.delete(file_id), lambda: globex.batches.retrieve(batch.id),
                 lambda: globex.batches.cancel(batch.id),
                 lambda: globex.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in globex.batches.list()]
    assert file_id in [f.id for f in acme.files.list(purpose="batch")]
    assert acme.files.retrieve(file_id).bytes > 0
    wait_for(acme, batch.id, {"completed"})
    ids = [b.id for b in acme.batches.list(limit=1)]  # the SDK pages through with `after`
    assert batch.id in ids and len(ids) == len(set(ids))


def test_cancel_runs_no_line_not_started_and_keeps_what_finished(gateway, keys):
    c = client(gateway, keys["acme"])
    lines = [chat_line(f"c{i}", f"Count to {i}.", 24) for i in range(24)]
    batch = c.batches.create(input_file_id=upload(c, lines), endpoint=CHAT, completion_window="24h")
    wait_for(c, batch.id, {"in_progress"}, 60)
    cancelling = c.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_for(c, batch.id, {"cancelled"}, 120)
    out, errs = results(c, done.output_file_id), results(c, done.error_file_id)
    assert sorted(x["custom_id"] for x in out + errs) == sorted(ln["custom_id"] for ln in lines)
    assert errs and {e["error"]["code"] for e in errs} == {"batch_cancelled"}
    assert (done.request_counts.completed, done.request_counts.failed) == (len(out), len(errs))
    assert c.batches.cancel(batch.id).status == "cancelled"  # again: no error
    small = c.batches.create(input_file_id=upload(c, lines[:1]), endpoint=CHAT, completion_window="24h")
    wait_for(c, small.id, {"completed"})
    with pytest.raises(openai.ConflictError):  # a completed batch cannot be cancelled
        c.batches.cancel(small.id)


def test_an_expired_batch_reports_its_unfinished_lines(gateway, keys):
    c = client(gateway, keys["acme"])
    lines = [chat_line(f"e{i}", f"Tell a story about {i}.", 64) for i in range(32)]  # far more than 2 s of work
    batch = c.batches.create(input_file_id=upload(c, lines), endpoint=CHAT, completion_window="2s")
    done = wait_for(c, batch.id, {"expired", "completed"}, 60)
    assert done.status == "expired" and done.expired_at
    out, errs = results(c, done.output_file_id), results(c, done.error_file_id)
    assert sorted(x["custom_id"] for x in out + errs) == sorted(ln["custom_id"] for ln in lines)
    assert errs and {e["error"]["code"] for e in errs} == {"batch_expired"}


def test_a_gateway_restarted_mid_batch_resumes_without_redoing_or_losing_a_line(tmp_path, worker):
    g = start_gateway(tmp_path, worker)
    try:
        key = create_key(tmp_path, "--tenant", "acme")
        c = client(g, key)
        lines = [chat_line(f"r{i}", f"Name the number {i}.", 16) for i in range(12)]
        batch = c.batches.create(input_file_id=upload(c, lines), endpoint=CHAT, completion_window="24h")
        deadline = time.monotonic() + 180
        while c.batches.retrieve(batch.id).request_counts.completed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        g.proc.kill()  # a crash: lines in flight are neither finished nor acknowledged
        g.stop()
        sent = len(worker.generate_bodies)
        g = start_gateway(tmp_path, worker)
        c = client(g, key)
        done = wait_for(c, batch.id, {"completed"})
        out = results(c, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(ln["custom_id"] for ln in lines)  # once each
        assert done.request_counts.completed == 12 and done.error_file_id is None
        assert len(worker.generate_bodies) - sent < 12  # the lines finished before the crash did not run again
    finally:
        g.stop()


# vLLM's scrape with nothing running: the gateway treats the proxied worker as a vLLM worker
IDLE_VLLM = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2-135m"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smollm2-135m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2-135m"} 0.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="1000"} 1.0
"""


def test_a_vllm_worker_gets_the_class_as_its_priority_and_batch_lines_run_through_it(tmp_path, cloud_worker):
    from tests.integration.faulty_openai import FaultyOpenAIWorker

    vllm = FaultyOpenAIWorker(cloud_worker.url, metrics_text=IDLE_VLLM).start()
    g = Server(tmp_path, ["cloud", "serve"], "--workers", vllm.url, "--worker-type", "vllm",
               env={"CASCADE_CLOUD_GATEWAY_FOREIGN_PRIORITY": "true"}).wait_healthy(60)
    try:
        c = client(g, create_key(tmp_path, "--tenant", "acme"))
        ask = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        c.chat.completions.create(**ask)
        c.chat.completions.create(**ask, extra_headers={"X-Cascade-Priority": "escalation"})
        c.chat.completions.create(**ask, extra_headers={"X-Cascade-Priority": "batch"}, extra_body={"priority": 3})
        assert [b.get("priority") for b in vllm.bodies] == [0, 1, 3]  # the client's own priority stays
        assert not any("priority_class" in b for b in vllm.bodies)
        lines = [chat_line(f"v{i}", f"Name a colour {i}.", 6) for i in range(3)]
        batch = c.batches.create(input_file_id=upload(c, lines), endpoint=CHAT, completion_window="24h")
        done = wait_for(c, batch.id, {"completed"}, 120)
        out = results(c, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == ["v0", "v1", "v2"]
        assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["choices"][0]["finish_reason"] in
                   ("stop", "length") for o in out)
        assert [b.get("priority") for b in vllm.bodies[3:]] == [2, 2, 2]
    finally:
        g.stop()
        vllm.stop()


def test_online_load_preempts_a_running_batch_and_every_line_is_still_answered_once_as_online(tmp_path,
                                                                                          smollm2_engine):
    """A gateway and its worker with a KV cache of 40 blocks: batch lines run (four at a time), then
    five online requests come that need more KV than the batch leaves. The gateway lets them in (the
    batch's blocks are free to an online request) and the engine preempts batch lines for them; the
    batch resumes once they are done, and every line is answered once, as the same request online.
    The test holds the batch by construction, not by timing: once batch lines run, the worker is
    stopped (SIGSTOP) until the gateway has passed all five online requests on to it, so no batch
    line can finish before they are queued (a busy machine once let the batch end first)."""
    from cloud_tier.engine.model_runner import ModelRunner
    from tests import loopback

    per_block = ModelRunner.bytes_per_block(smollm2_engine.model, 16, smollm2_engine.dtype)
    w = Server(tmp_path, ["cloud", "worker"], "--role", "both", "--model", str(smollm2_engine.model_dir),
               "--max-model-len", "512", "--kv-cache-bytes", str(40 * per_block))
    g = proxy = None
    try:
        w.wait_healthy(300)
        proxy = FaultyWorker(w.url).start()  # passes everything through; records what the gateway sends
        g = Server(tmp_path, ["cloud", "serve"], "--workers", proxy.url).wait_healthy(180)

        def engine() -> dict:
            return loopback.get(f"{w.url}/healthz").json()["engine"]

        assert engine()["kv_blocks_total"] == 40
        c = client(g, create_key(tmp_path, "--tenant", "acme"))
        online = client(g, create_key(tmp_path, "--tenant", "online"))
        model = c.models.list().data[0].id  # the converted model's directory, served by its path
        lines = [chat_line(f"b{i}", f"Tell a story about the number {i}.", 48) for i in range(8)]
        for ln in lines:  # ~5 blocks each for a while: four of them hold half the cache
            ln["body"].update(model=model, ignore_eos=True)
        asks = [dict(model=model, messages=[{"role": "user", "content": f"Describe a city, number {i}."}],
                     max_tokens=64, temperature=0, extra_body={"ignore_eos": True}) for i in range(5)]
        batch = c.batches.create(input_file_id=upload(c, lines), endpoint=CHAT, completion_window="24h")
        deadline = time.monotonic() + 120
        while engine()["running"] < 3:
            assert time.monotonic() < deadline, "the batch lines never ran"
            time.sleep(0.05)
        answers = _asked_while_stopped(w, proxy, online, asks)
        assert all(a.usage.completion_tokens == 64 for a in answers)
        assert engine()["preemptions"] > 0  # batch lines gave their KV up to the online requests
        done = wait_for(c, batch.id, {"completed", "failed"}, 300)
        assert done.status == "completed" and done.request_counts.completed == 8 and done.error_file_id is None
        out = {o["custom_id"]: o for o in results(c, done.output_file_id)}
        assert sorted(out) == sorted(ln["custom_id"] for ln in lines)  # each line once

        def asked_online(ln: dict):
            body = {k: v for k, v in ln["body"].items() if k != "ignore_eos"}
            return online.chat.completions.create(**body, extra_body={"ignore_eos": True})

        # four side by side (as the batch ran them: four fit the 40 blocks with room), not eight runs in turn
        with ThreadPoolExecutor(4) as pool:
            again = list(pool.map(asked_online, lines))
        for ln, a in zip(lines, again, strict=True):  # resumed (recomputed or swapped back in) exactly where it was
            assert out[ln["custom_id"]]["response"]["body"]["choices"][0]["message"]["content"] == \
                a.choices[0].message.content, ln["custom_id"]
    finally:
        for it in (g, proxy, w):
            if it is not None:
                it.stop()


def _asked_while_stopped(worker: Server, proxy: FaultyWorker, online: openai.OpenAI, asks: list[dict]) -> list:
    """The online answers to ``asks``, sent while ``worker`` is stopped (SIGSTOP): it runs again
    once the gateway has passed every one of them on (the proxy has them), so they are queued
    on the worker before any batch line it holds can finish."""
    import os
    import signal

    os.killpg(worker.proc.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(len(asks)) as pool:
            pending = [pool.submit(online.chat.completions.create, **a) for a in asks]
            deadline = time.monotonic() + 30
            while sum(b["record"]["tenant"] == "online" for b in proxy.generate_bodies) < len(asks):
                assert time.monotonic() < deadline, "the gateway did not pass the online requests on"
                assert not any(f.done() for f in pending), [f.result() for f in pending if f.done()]
                time.sleep(0.02)
            time.sleep(0.2)  # the proxy's own send to the worker's socket
            os.killpg(worker.proc.pid, signal.SIGCONT)
            return [f.result() for f in pending]
    finally:
        os.killpg(worker.proc.pid, signal.SIGCONT)
