"""Issue 37 item 1 end to end: a real edge agent (SmolLM2 on llama.cpp) whose offline queue holds
a request the cloud answers 500 every time (an OpenAI error body, this prompt only) while it
answers every other request. The poison request ends ``failed`` after ``[sync] max_attempts``;
meanwhile the circuit stays closed and other sessions' live escalations go to the cloud (not to
the queue); the next request of its session is delivered once it has failed. The cloud is a
small in-process HTTP server that injects the fault."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sync.queue import Kind, OfflineQueue
from tests import loopback
from tests.conftest import Agent

MODEL = "smollm2-135m"
MAX_ATTEMPTS = 4


class PoisonCloud(BaseHTTPRequestHandler):
    """OpenAI-shaped: a model list, completions (streamed or not), and a 500 for "poison"."""

    calls: list[str] = []

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, json.dumps({"object": "list", "data": [{"id": "cloud-model", "object": "model"}]}).encode())

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        text = req["messages"][-1]["content"]
        self.calls.append(text)
        if "poison" in text:
            err = {"message": "the model failed on this prompt", "type": "server_error", "param": None,
                   "code": "internal_error"}
            return self._send(500, json.dumps({"error": err}).encode())
        msg = {"id": "c1", "object": "chat.completion", "created": 1, "model": "cloud-model",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "from the cloud"},
                            "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
        if not req.get("stream"):
            return self._send(200, json.dumps(msg).encode())
        chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "cloud-model"}
        events = [{**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "from the cloud"},
                                         "finish_reason": None}]},
                  {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                  {**chunk, "choices": [], "usage": msg["usage"]}]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self._send(200, body.encode(), "text/event-stream")


@pytest.fixture
def cloud():
    PoisonCloud.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), PoisonCloud)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def request(agent: Agent, item_id: str) -> dict:
    r = loopback.get(f"{agent.url}/v1/requests/{item_id}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_poison_request_fails_after_max_attempts_and_holds_back_neither_the_device_nor_its_session(
        tmp_path, cloud):
    db = tmp_path / "queue.db"
    q = OfflineQueue(db)  # queued by an earlier run, while the cloud was away
    poison = q.enqueue(Kind.REQUEST, {"model": MODEL, "messages": [{"role": "user", "content": "poison"}],
                                      "max_tokens": 4}, endpoint="chat", session="s1")
    after = q.enqueue(Kind.REQUEST, {"model": MODEL, "messages": [{"role": "user", "content": "next in s1"}],
                                     "max_tokens": 4}, endpoint="chat", session="s1")
    q.close()
    env = {"CASCADE_EDGE_UPSTREAM_URL": f"http://127.0.0.1:{cloud.server_port}/v1",
           "CASCADE_EDGE_UPSTREAM_TIMEOUT_S": "10", "CASCADE_EDGE_UPSTREAM_MAX_BACKOFF_S": "30",
           "CASCADE_EDGE_CASCADE_OFFLINE": "queue", "CASCADE_EDGE_SYNC_PATH": str(db),
           "CASCADE_EDGE_SYNC_MAX_ATTEMPTS": str(MAX_ATTEMPTS), "CASCADE_EDGE_SYNC_BASE_BACKOFF_S": "1",
           "CASCADE_EDGE_SYNC_MAX_BACKOFF_S": "1", "CASCADE_EDGE_SYNC_POLL_S": "0.2"}
    agent = Agent(tmp_path, "--n-ctx", "256", "--threads", "1", "--no-config", env=env).wait_healthy()
    try:
        deadline = time.monotonic() + 20
        while request(agent, poison)["attempts"] < 1:
            assert time.monotonic() < deadline, "the queued request was never tried"
            time.sleep(0.1)
        answers = []
        for n in range(4):  # while the poison request is tried again and again
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"live {n}"}], "max_tokens": 4,
                    "cascade": {"mode": "cloud", "session": f"live{n}"}}
            answers.append(loopback.post(f"{agent.url}/v1/chat/completions", json=body, timeout=30))
        assert [(r.status_code, r.headers.get("x-cascade-tier")) for r in answers] == [(200, "cloud")] * 4, \
            [r.text[:200] for r in answers]
        assert loopback.get(f"{agent.url}/healthz", timeout=10).json()["upstream"]["circuit"] == "closed"
        while (state := request(agent, poison))["state"] in ("queued", "sending"):
            assert request(agent, after)["attempts"] == 0  # its session's order holds meanwhile
            assert time.monotonic() < deadline + 20, "the poison request was never given up"
            time.sleep(0.1)
        assert state["state"] == "failed" and state["status"] == 500 and state["attempts"] == MAX_ATTEMPTS
        assert state["error"]["code"] == "internal_error" and state["last_error"].startswith(
            f"failed {MAX_ATTEMPTS} times: HTTP 500")
        while (nxt := request(agent, after))["state"] in ("queued", "sending"):
            assert time.monotonic() < deadline + 30, "the next request of the session stayed queued"
            time.sleep(0.1)
        assert nxt["state"] == "done" and nxt["last_error"] is None
        assert PoisonCloud.calls.count("poison") == MAX_ATTEMPTS
        assert loopback.get(f"{agent.url}/healthz", timeout=10).json()["upstream"]["circuit"] == "closed"
    finally:
        agent.stop()


def test_a_live_poison_prompt_is_served_another_way_and_leaves_the_circuit_closed(tmp_path, cloud):
    """The live escalation path: the cloud failing one prompt (a 500 with an OpenAI error) is that
    request's failure, not an outage: it is served by its offline policy, the circuit stays
    closed, and the next prompt still goes up."""
    env = {"CASCADE_EDGE_UPSTREAM_URL": f"http://127.0.0.1:{cloud.server_port}/v1",
           "CASCADE_EDGE_UPSTREAM_TIMEOUT_S": "10", "CASCADE_EDGE_UPSTREAM_MAX_BACKOFF_S": "30"}
    agent = Agent(tmp_path, "--n-ctx", "256", "--threads", "1", "--no-config", env=env).wait_healthy()
    try:
        def ask(text: str, offline: str):
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4,
                    "cascade": {"mode": "cloud", "offline": offline}}
            return loopback.post(f"{agent.url}/v1/chat/completions", json=body, timeout=30)

        for _ in range(3):  # offline "fail": answered at once, so the circuit is read right after
            bad = ask("poison", "fail")
            assert bad.status_code == 503 and bad.json()["error"]["code"] == "cloud_unavailable", bad.text[:200]
            upstream = loopback.get(f"{agent.url}/healthz", timeout=10).json()["upstream"]
            assert upstream["circuit"] == "closed", upstream
        local = ask("poison", "local")
        assert local.status_code == 200 and local.headers["x-cascade-tier"] == "edge", local.text[:200]
        good = ask("an honest question", "fail")
        assert good.status_code == 200 and good.headers["x-cascade-tier"] == "cloud", good.text[:200]
    finally:
        agent.stop()
