"""A worker in front of a real one, to inject faults between the gateway and it: it passes
``/internal/load``, ``/internal/tokenizer``, ``/internal/stats`` and ``/healthz`` through, and answers
``/internal/generate`` as ``mode`` says (pass through, an HTTP error, a stream cut after a few
events, a slow start or slow events, or a ``script`` of raw lines and stalls: the hostile worker).
It records the body of every generate call."""

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
from tests.integration.faulty_openai import play


@dataclass
class Mode:
    """What the next /internal/generate calls get."""

    status: int = 200  # not 200: answer this status with ``error`` as the OpenAI-style body
    error: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    cut_after: int | None = None  # end the stream after this many events, without a finish
    first_delay_s: float = 0.0  # before the response starts
    event_delay_s: float = 0.0  # before each event is passed on
    # answer 200 with exactly these parts instead (str: bytes sent as they are; float: a stall of that many
    # seconds, after the headers): see ``token_line``, ``finish_line``
    script: list | None = None


def token_line(text: str = "hi", token_id: int = 42) -> str:
    """One token event as our worker sends it (a line of NDJSON; the text as it is, raw)."""
    return json.dumps({"token": [token_id, text, text.encode().hex(), -0.5, 0.1, []]}, ensure_ascii=False) + "\n"


def finish_line(prompt: object = 9, completion: object = 2, reason: str = "stop") -> str:
    """The finish event, with whatever usage numbers it is given."""
    return json.dumps({"finish": [reason, prompt, completion, 0, ""]}) + "\n"


class FaultyWorker:
    def __init__(self, target_url: str):
        self.target = target_url
        self.mode = Mode()
        self.generate_bodies: list[dict] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self._app(), host="127.0.0.1", port=self.port,
                                                     log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> FaultyWorker:
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

        @app.get("/internal/load")
        @app.get("/internal/tokenizer")
        @app.get("/internal/stats")
        @app.get("/healthz")
        async def passed(request: Request) -> Response:
            r = await client.get(f"{self.target}{request.url.path}")
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

        @app.post("/internal/generate")
        async def generate(request: Request):
            body = await request.body()
            self.generate_bodies.append(json.loads(body))
            mode = self.mode
            if mode.first_delay_s:
                await asyncio.sleep(mode.first_delay_s)
            if mode.status != 200:
                return JSONResponse({"error": mode.error}, status_code=mode.status, headers=mode.headers)
            if mode.script is not None:
                return StreamingResponse(play(mode.script), media_type="application/x-ndjson")
            req = client.build_request("POST", f"{self.target}/internal/generate", content=body,
                                       headers={"content-type": "application/json"})
            resp = await client.send(req, stream=True)
            if resp.status_code != 200:
                content = await resp.aread()
                return Response(content, status_code=resp.status_code, media_type="application/json")
            return StreamingResponse(self._relay(resp, mode), media_type="application/x-ndjson")

        return app

    async def _relay(self, resp: httpx.Response, mode: Mode):
        n = 0
        try:
            async for line in resp.aiter_lines():
                if not line:
                    continue
                if mode.cut_after is not None and n >= mode.cut_after:
                    return
                if mode.event_delay_s:
                    await asyncio.sleep(mode.event_delay_s)
                n += 1
                yield line + "\n"
        finally:
            await resp.aclose()
