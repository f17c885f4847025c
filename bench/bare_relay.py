"""The floor of a Python gateway's relay: a bare FastAPI app on the gateway's server stack (uvicorn,
uvloop, httptools) that passes a worker's streamed answer to the client as the bytes come, with
aiohttp, and nothing else: no key, quota, check, parse or record. bench/gateway_capacity.py runs
it as the peer of `cascade cloud serve` (the cost of moving bytes, issue 42).

    python bench/bare_relay.py --port 8200 --worker http://127.0.0.1:8100
"""

from __future__ import annotations

import argparse

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


def build(worker: str) -> FastAPI:
    app = FastAPI()
    session: list[aiohttp.ClientSession] = []

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def relay(request: Request):
        if not session:
            session.append(aiohttp.ClientSession())
        resp = await session[0].post(f"{worker}/v1/chat/completions", data=await request.body(),
                                     headers={"content-type": "application/json"})

        async def body():
            try:
                while data := await resp.content.readany():
                    yield data
            finally:
                resp.release()

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--worker", required=True)
    args = p.parse_args()
    uvicorn.run(build(args.worker), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
