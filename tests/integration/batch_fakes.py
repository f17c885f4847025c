"""An in-process gateway (the real ``build_app``, on a loopback port, in a thread) in front of a
model-free OpenAI-compatible worker, for the Batch API's fault and noisy-neighbour tests. The
worker answers every completion at once with a short canned answer and true usage, unless
``hook(body)`` (an async function the test sets) answers instead: a refusal, a stall, an error.
Nothing here stands in for the gateway; the worker is a fake only to inject faults cheaply."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cascade import wire
from cascade.processes import free_port

MODEL = "fake-model"


class _Thread:
    """A uvicorn server in a daemon thread on a free loopback port."""

    def __init__(self, app, lifespan: str = "off"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     lifespan=lifespan, timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self, timeout_s: float = 60):
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(15)


class FakeOpenAIWorker(_Thread):
    """A model-free OpenAI-compatible worker; ``bodies`` holds every completion body it was sent."""

    def __init__(self):
        self.hook = None  # async (body) -> Response | None: None answers normally
        self.bodies: list[dict] = []
        super().__init__(self._app())

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}

        @app.get("/metrics")
        async def metrics():
            return Response(status_code=404)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = wire.loads(await request.body(), limit=1 << 24, int64=False)
            self.bodies.append(body)
            if self.hook is not None:
                answer = await self.hook(body)
                if answer is not None:
                    return answer
            return JSONResponse(answer_of(body))

        return app


def answer_of(body: dict) -> dict:
    return {"id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()), "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}


def refuse(status: int, code: str, delay_s: float = 0.0):
    """A hook's answer: ``status`` with an OpenAI-style error body, after ``delay_s``."""
    async def later():
        await asyncio.sleep(delay_s)
        return JSONResponse({"error": {"message": "injected", "type": "server_error", "param": None, "code": code}},
                            status_code=status)
    return later()


class InProcessGateway(_Thread):
    """``build_app`` with its lifespan, keys and batches under ``home``, fronting ``worker_url``
    as an ``openai`` worker; ``gateway`` overrides GatewayConfig fields (the batch ones too)."""

    def __init__(self, home: Path, worker_url: str, **gateway):
        from cloud_tier.config import CloudConfig, GatewayConfig
        from cloud_tier.gateway.http.app import build_app

        self.home = home
        self.config = CloudConfig(gateway=GatewayConfig(
            workers=worker_url, worker_type="openai", db=str(home / "gateway.db"), health_interval_s=0.2,
            metrics_interval_s=0.2, startup_timeout_s=30, **gateway))
        self.app = build_app(self.config, [worker_url])
        super().__init__(self.app, lifespan="on")

    def key(self, tenant: str) -> str:
        """A new key of ``tenant`` (the key store is the gateway's own SQLite file)."""
        from cloud_tier.gateway.tenants.keys_sqlite import KeyStore

        store = KeyStore(self.home / "gateway.db")
        try:
            return store.create(tenant)[0]
        finally:
            store.close()
