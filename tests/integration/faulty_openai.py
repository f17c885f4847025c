"""An OpenAI-compatible worker in front of a real one, to inject faults between the gateway and
it: health, models and metrics pass through; the completion endpoints answer as ``mode`` says
(pass through, an HTTP error, an HTML page, a stream cut after a few chunks, a stall before the
first byte, or a ``script`` of raw bytes and stalls: the hostile worker). With no target it is a
worker of its own: /v1/models names ``MODEL`` and an honest request gets a short synthetic answer
(no model needed). It records every completion body and request id it was sent."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cascade.processes import free_port


@dataclass
class Mode:
    status: int = 200  # not 200: answer this status with ``error`` as the OpenAI-style body
    error: dict = field(default_factory=lambda: {"message": "injected", "type": "server_error"})
    html: bool = False  # answer 200 with an HTML page instead
    cut_after: int | None = None  # end the stream after this many chunks, without [DONE]
    stall_s: float = 0.0  # before the response starts
    health_status: int = 200
    kv_params: dict | None = None  # add these kv_transfer_params to a JSON answer (a KV connector's reply)
    # answer 200 with exactly these parts (str: bytes sent as they are; float: a stall of that many seconds,
    # after the headers), whatever the request asked (stream or not): see ``sse``, ``honest_chunks``
    script: list | None = None


MODEL = "smollm2-135m"


def sse(*chunks) -> list[str]:
    """SSE events: a dict as ``data: {json}``, "[DONE]" as the end, a str as it is."""
    return [c if isinstance(c, str) and c != "[DONE]" else
            "data: [DONE]\n\n" if c == "[DONE]" else f"data: {json.dumps(c, ensure_ascii=False)}\n\n"
            for c in chunks]


def honest_chunks(chat: bool = True, words: tuple[str, ...] = ("Red", ",", " blue")) -> list[dict]:
    """The chunks of a short streamed answer (the usage chunk last), as vLLM sends them."""
    base = {"id": "cmpl-fake", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1, "model": MODEL}
    chunks = []
    for i, w in enumerate(words):
        choice = {"index": 0, "delta": {"role": "assistant", "content": w}} if chat else {"index": 0, "text": w}
        chunks.append({**base, "choices": [{**choice, "finish_reason": "stop" if i == len(words) - 1 else None}]})
    return chunks + [{**base, "choices": [], "usage": usage(9, len(words))}]


def honest_body(chat: bool = True, text: str = "Red, blue", usage_: object = None) -> dict:
    """A non-streamed answer: ``usage_`` as given (None: an honest one; "missing": none)."""
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"} if chat
              else {"index": 0, "text": text, "finish_reason": "stop"})
    body = {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion", "created": 1,
            "model": MODEL, "choices": [choice]}
    if usage_ != "missing":
        body["usage"] = usage(9, 3) if usage_ is None else usage_
    return body


def usage(prompt: object, completion: object) -> dict:
    total = prompt + completion if all(isinstance(x, int) for x in (prompt, completion)) else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}


class FaultyOpenAIWorker:
    def __init__(self, target_url: str | None = None, metrics_text: str | None = None):
        self.target = target_url
        self.metrics_text = metrics_text  # answer /metrics with this (e.g. a vLLM scrape) instead of passing through
        self.mode = Mode()
        self.bodies: list[dict] = []
        self.request_ids: list[str | None] = []
        self.headers: list[dict[str, str]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self._app(), host="127.0.0.1", port=self.port,
                                                     log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> FaultyOpenAIWorker:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the faulty worker did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def _app(self) -> FastAPI:
        app = FastAPI()
        client = httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0))

        @app.get("/health")
        async def health() -> Response:
            if self.mode.health_status != 200:
                return Response(status_code=self.mode.health_status)
            if self.target is None:
                return Response(status_code=200)
            r = await client.get(f"{self.target}/health")
            return Response(r.content, status_code=r.status_code)

        @app.get("/metrics")
        async def metrics() -> Response:
            if self.metrics_text is not None or self.target is None:
                return Response(self.metrics_text or "", media_type="text/plain")
            r = await client.get(f"{self.target}/metrics")
            return Response(r.content, status_code=r.status_code, media_type="text/plain")

        @app.get("/internal/load")
        async def load() -> Response:  # ours only: lets the gateway see it is our worker, and its load
            r = await client.get(f"{self.target}/internal/load")
            return Response(r.content, status_code=r.status_code, media_type="application/json")

        @app.get("/v1/models")
        async def models() -> Response:
            if self.target is None:
                return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                                 "max_model_len": 1024}]})
            r = await client.get(f"{self.target}/v1/models")
            return Response(r.content, status_code=r.status_code, media_type="application/json")

        @app.post("/v1/chat/completions")
        @app.post("/v1/completions")
        async def complete(request: Request):
            body = await request.body()
            self.bodies.append(json.loads(body))
            self.request_ids.append(request.headers.get("x-request-id"))
            self.headers.append(dict(request.headers))
            mode = self.mode
            if mode.stall_s:
                await asyncio.sleep(mode.stall_s)
            if mode.html:
                return Response("<html><body>502 Bad Gateway</body></html>", media_type="text/html")
            if mode.status != 200:
                return JSONResponse({"error": mode.error}, status_code=mode.status)
            if mode.script is not None:
                return StreamingResponse(play(mode.script), media_type="text/event-stream")
            if self.target is None:
                chat = request.url.path.endswith("chat/completions")
                if json.loads(body).get("stream"):
                    return StreamingResponse(play(sse(*honest_chunks(chat), "[DONE]")),
                                             media_type="text/event-stream")
                return JSONResponse(honest_body(chat))
            passed = {k: v for k, v in request.headers.items() if k in ("x-request-id", "x-cascade-deadline")}
            req = client.build_request("POST", f"{self.target}{request.url.path}", content=body,
                                       headers={"content-type": "application/json", **passed})
            resp = await client.send(req, stream=True)
            if resp.status_code != 200 or "text/event-stream" not in resp.headers.get("content-type", ""):
                content = await resp.aread()
                if mode.kv_params is not None and resp.status_code == 200:
                    content = json.dumps({**json.loads(content), "kv_transfer_params": mode.kv_params}).encode()
                return Response(content, status_code=resp.status_code, media_type="application/json")
            return StreamingResponse(self._relay(resp, mode), media_type="text/event-stream")

        return app

    async def _relay(self, resp: httpx.Response, mode: Mode):
        n = 0
        try:
            async for line in resp.aiter_lines():
                if not line:
                    continue
                if mode.cut_after is not None and n >= mode.cut_after:
                    return
                n += 1
                yield line + "\n\n"
        finally:
            await resp.aclose()


async def play(script: list):
    """A script's parts as a response body: strings and bytes sent, floats slept."""
    for part in script:
        if isinstance(part, float):
            await asyncio.sleep(part)
        else:
            yield part.encode() if isinstance(part, str) else part
