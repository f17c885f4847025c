"""A cloud that misbehaves on purpose, for the edge agent's escalation and delivery paths.

A raw-socket HTTP/1.1 server on loopback (each answer on its own connection, so it can cut one
at any byte): it answers like an OpenAI server (``good``), or like a captive portal, a proxy, a
broken or hostile peer, as ``behave`` says. It records every request it read.

Behaviours (for POST /v1/chat/completions; GET /v1/models follows ``models``):
  good                  a stream with [DONE] (stream) or a JSON chat.completion
  html                  200 text/html (a captive portal)
  json_not_completion   200 application/json that is not a completion
  sse_for_json          200 text/event-stream to a request that asked for JSON
  truncated             a stream cut after two content chunks: no finish reason, no [DONE]
  truncated_after_finish  a stream with its finish reason, cut before [DONE] (complete)
  empty_stream          200 text/event-stream and nothing
  malformed             a first SSE line that is not JSON
  error_string          an in-band error whose ``error`` is a string, not an object
  chunk_not_object      a first chunk that is a JSON list
  bad_choices           a chunk whose ``choices`` is a string
  slow_first_byte       the status line only after ``delay_s``
  retry_after_date      503 with Retry-After as an HTTP-date ``delay_s`` ahead
  retry_after_absurd    429 with ``Retry-After: 1e400``
  retry_after_negative  429 with ``Retry-After: -5``
  reset_before_headers  the connection closed once the request is read
  reset_mid_headers     half a status line, then closed
  reset_mid_body        a JSON completion's headers and half its body (or a stream's first chunk), then closed
  refuse                401 (a wrong or revoked key)
  forbid                403
  bad_request           400 with an OpenAI error body
  server_error_html     502 with an HTML body (a proxy's error page)
"""

from __future__ import annotations

import json
import socket
import threading
import time
from email.utils import formatdate

from cascade.processes import free_port
from tests.faults import close_socket

MODEL = "cloud-model"


class MisbehavingCloud:
    def __init__(self, port: int = 0):
        self.port = port or free_port()
        self.behave = "good"
        self.models = "good"  # good | html | refuse | garbage
        self.delay_s = 2.0
        self.requests: list[dict] = []  # {"method", "path", "headers", "body"}
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set(self, behave: str, models: str | None = None) -> MisbehavingCloud:
        with self._lock:
            self.behave = behave
            self.models = models or ("refuse" if behave in ("refuse", "forbid") else "good")
        return self

    def posts(self) -> list[dict]:
        with self._lock:
            return [r for r in self.requests if r["method"] == "POST"]

    def start(self) -> MisbehavingCloud:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(64)
        self._listener = ls
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _accept(self) -> None:
        while self._listener is not None:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            req = _read_request(conn)
            if req is None:
                return
            with self._lock:
                self.requests.append(req)
                behave, models = self.behave, self.models
            if req["method"] == "GET" and req["path"].startswith("/v1/models"):
                self._models(conn, models)
            else:
                self._completion(conn, req, behave)
        except OSError:
            pass
        finally:
            close_socket(conn)

    def _models(self, conn: socket.socket, how: str) -> None:
        if how == "html":
            _send(conn, 200, "text/html", b"<html><body>Please log in to the hotel wifi</body></html>")
        elif how == "refuse":
            _send(conn, 401, "application/json", _error("Invalid API key", "invalid_api_key"))
        elif how == "garbage":
            _send(conn, 200, "application/json", b'{"data": "nope"}')
        else:
            _send(conn, 200, "application/json",
                  json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode())

    def _completion(self, conn: socket.socket, req: dict, how: str) -> None:
        body = json.loads(req["body"] or b"{}")
        stream = bool(body.get("stream"))
        if how == "good":
            return _answer(conn, stream)
        if how == "html":
            return _send(conn, 200, "text/html", b"<html><body>Please log in to the hotel wifi</body></html>")
        if how == "json_not_completion":
            return _send(conn, 200, "application/json", b'{"status": "ok"}')
        if how == "sse_for_json":
            return _send(conn, 200, "text/event-stream", _chunk({"role": "assistant"}) + b"data: [DONE]\n\n")
        if how in ("truncated", "truncated_after_finish"):
            data = _chunk({"role": "assistant"}) + _chunk({"content": "Half an"}) + _chunk({"content": " answer"})
            if how == "truncated_after_finish":
                data += _chunk({}, "stop")
            return _send(conn, 200, "text/event-stream", data)
        if how == "empty_stream":
            return _send(conn, 200, "text/event-stream", b"")
        if how == "malformed":
            return _send(conn, 200, "text/event-stream", b"data: {not json\n\n")
        if how == "error_string":
            return _send(conn, 200, "text/event-stream", b'data: {"error": "overloaded"}\n\n')
        if how == "chunk_not_object":
            return _send(conn, 200, "text/event-stream", b"data: [1, 2]\n\n")
        if how == "bad_choices":
            return _send(conn, 200, "text/event-stream", _chunk({"role": "assistant"})
                         + b'data: {"id": "x", "choices": "nope"}\n\ndata: [DONE]\n\n')
        if how == "slow_first_byte":
            time.sleep(self.delay_s)
            return _answer(conn, stream)
        if how == "retry_after_date":
            return _send(conn, 503, "application/json", _error("busy", "busy"),
                         {"Retry-After": formatdate(time.time() + self.delay_s, usegmt=True)})
        if how == "retry_after_absurd":
            return _send(conn, 429, "application/json", _error("slow down", "rate_limit_exceeded"),
                         {"Retry-After": "1e400"})
        if how == "retry_after_negative":
            return _send(conn, 429, "application/json", _error("slow down", "rate_limit_exceeded"),
                         {"Retry-After": "-5"})
        if how == "reset_before_headers":
            return
        if how == "reset_mid_headers":
            conn.sendall(b"HTTP/1.1 20")
            return
        if how == "reset_mid_body":
            if stream:
                head = _head(200, "text/event-stream", None)
                conn.sendall(head + _chunk({"role": "assistant"}))
            else:
                full = _completion_json()
                conn.sendall(_head(200, "application/json", len(full)) + full[: len(full) // 2])
            return
        if how == "refuse":
            return _send(conn, 401, "application/json", _error("Invalid API key", "invalid_api_key"))
        if how == "forbid":
            return _send(conn, 403, "application/json", _error("This key is revoked", "key_revoked"))
        if how == "bad_request":
            return _send(conn, 400, "application/json", _error("bad temperature", "invalid_value"))
        if how == "server_error_html":
            return _send(conn, 502, "text/html", b"<html><body>502 Bad Gateway</body></html>")
        raise ValueError(f"unknown behaviour {how!r}")


def _answer(conn: socket.socket, stream: bool) -> None:
    if stream:
        data = (_chunk({"role": "assistant"}) + _chunk({"content": "The cloud"}) + _chunk({"content": " says hi."})
                + _chunk({}, "stop") + b'data: {"id": "c1", "choices": [], "usage": {"prompt_tokens": 5, '
                b'"completion_tokens": 3, "total_tokens": 8}}\n\ndata: [DONE]\n\n')
        _send(conn, 200, "text/event-stream", data)
    else:
        _send(conn, 200, "application/json", _completion_json())


def _completion_json() -> bytes:
    return json.dumps({"id": "c1", "object": "chat.completion", "created": int(time.time()), "model": MODEL,
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "The cloud says hi."},
                                    "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}).encode()


def _chunk(delta: dict, finish: str | None = None) -> bytes:
    c = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(c).encode() + b"\n\n"


def _error(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


def _head(status: int, content_type: str, length: int | None, headers: dict | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} X", f"Content-Type: {content_type}", "Connection: close"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _send(conn: socket.socket, status: int, content_type: str, body: bytes, headers: dict | None = None) -> None:
    length = None if content_type == "text/event-stream" else len(body)
    conn.sendall(_head(status, content_type, length, headers) + body)


def _read_request(conn: socket.socket) -> dict | None:
    conn.settimeout(30)
    data = b""
    while b"\r\n\r\n" not in data:
        part = conn.recv(65536)
        if not part:
            return None
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
    n = int(headers.get("content-length", 0))
    while len(body) < n:
        part = conn.recv(65536)
        if not part:
            break
        body += part
    return {"method": method, "path": path, "headers": headers, "body": body}
