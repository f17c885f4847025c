"""A synthetic OpenAI-compatible worker for measuring the gateway alone: it streams vLLM-shaped
chunks (one token a chunk, ``usage`` last when asked, ``exclude_unset`` as vLLM writes them) in
engine steps ``--tpot-ms`` apart (every running stream gets its next token at each step, one
after another, as continuous batching gives them), answers /health, /v1/models and a vLLM-sized
/metrics (~600 lines), and costs next to nothing itself (aiohttp, a pre-rendered chunk). Not a
stand-in for a worker in any test or result: the inputs of docs/scale.md's capacity model
(bench/gateway_capacity.py) are the gateway's own CPU, which needs a worker that answers at once.

    python bench/synthetic_worker.py --port 8100 [--tpot-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

MODEL = "smollm2-135m"


def metrics_text(lines: int = 600) -> str:
    """What vLLM's /metrics looks like to the gateway's scrape: its few series among many others."""
    head = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0',
            "# TYPE vllm:num_requests_waiting gauge", f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0.0',
            "# TYPE vllm:kv_cache_usage_perc gauge", f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.01',
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="4096",model_name="{MODEL}"}} 1.0']
    filler = [f'vllm:request_latency_seconds_bucket{{le="{i}",model_name="{MODEL}"}} {i}.0'
              for i in range(lines - len(head))]
    return "\n".join(head + filler) + "\n"


class Steps:
    """An engine's steps: whoever waits for the next one is woken with every other stream at it."""

    def __init__(self, tpot_s: float):
        self.tpot_s = tpot_s
        self._next: asyncio.Future | None = None

    async def wait(self) -> None:
        if self._next is None:
            loop = asyncio.get_running_loop()
            self._next = loop.create_future()
            loop.call_later(self.tpot_s, self._step)
        await asyncio.shield(self._next)

    def _step(self) -> None:
        step, self._next = self._next, None
        step.set_result(None)


def build(tpot_s: float) -> web.Application:
    metrics = metrics_text().encode()
    steps = Steps(tpot_s)

    async def health(_):
        return web.Response(text="")

    async def models(_):
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "bench", "max_model_len": 2048}]})

    async def scrape(_):
        return web.Response(body=metrics, content_type="text/plain")

    async def complete(request: web.Request):
        body = json.loads(await request.read())
        chat = request.path.endswith("/chat/completions")
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        rid = f"chatcmpl-{time.monotonic_ns()}"
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": MODEL}
        if not body.get("stream"):
            text = " word" * n
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"} if chat
                      else {"index": 0, "text": text, "finish_reason": "length"})
            return web.json_response({**base, "object": "chat.completion" if chat else "text_completion",
                                      "choices": [choice], "usage": {"prompt_tokens": 10, "completion_tokens": n,
                                                                     "total_tokens": 10 + n}})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        delta = (lambda t, f: {"index": 0, "delta": {"content": t}, "logprobs": None, "finish_reason": f}) if chat \
            else (lambda t, f: {"index": 0, "text": t, "logprobs": None, "finish_reason": f})
        token = ("data: " + json.dumps({**base, "choices": [delta(" word", None)]}, separators=(",", ":")) + "\n\n"
                 ).encode()
        for i in range(n):
            if tpot_s:
                await steps.wait()
            last = i == n - 1
            await resp.write(token if not last else ("data: " + json.dumps(
                {**base, "choices": [delta(" word", "length")]}, separators=(",", ":")) + "\n\n").encode())
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {**base, "choices": [],
                     "usage": {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}}
            await resp.write(("data: " + json.dumps(usage, separators=(",", ":")) + "\n\n").encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", scrape)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tpot-ms", type=float, default=0.0)
    args = p.parse_args()
    web.run_app(build(args.tpot_ms / 1000), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
