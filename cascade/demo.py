"""``cascade demo``: the product on one machine, as a scripted scenario.

Today: an edge agent (SmolLM2-135M-Instruct Q4_1 on llama.cpp) in its own process, a few
requests streamed through its OpenAI-compatible API, its metrics, and how to talk to it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the agent exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become healthy in {timeout_s:.0f} s")


def stream_chat(base: str, prompt: str) -> dict:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 64, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    usage = {}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        tier = r.headers.get("x-cascade-tier")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                text = choice["delta"].get("content")
                if text:
                    first = first or time.perf_counter()
                    sys.stdout.write(text)
                    sys.stdout.flush()
    total = time.perf_counter() - start
    print()
    n = usage.get("completion_tokens", 0)
    ttft = (first - start) if first else total
    return {"tier": tier, "tokens": n, "ttft_ms": ttft * 1000,
            "tok_s": (n - 1) / (total - ttft) if n > 1 and total > ttft else 0.0}


def main(args) -> int:
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    home = os.environ.get("CASCADE_HOME") or tempfile.mkdtemp(prefix="cascade-demo-")
    env = {**os.environ, "CASCADE_HOME": home, "OMP_WAIT_POLICY": "passive",
           "CASCADE_EDGE_SERVER_LOG_LEVEL": "warning"}
    logging.getLogger("httpx").setLevel(logging.WARNING)
    print(f"== starting the edge agent on {base} (CASCADE_HOME={home})")
    proc = subprocess.Popen([sys.executable, "-m", "cascade.cli", "--log-level", "WARNING",
                             "edge", "run", "--port", str(port)], env=env)
    try:
        wait_healthy(base, proc)
        models = httpx.get(f"{base}/v1/models").json()["data"]
        print(f"== serving {models[0]['id']} ({models[0]['meta']['quantization']}, "
              f"n_ctx {models[0]['meta']['n_ctx']})\n")
        rows = []
        for prompt in PROMPTS:
            print(f"-- user: {prompt}\n-- assistant: ", end="")
            rows.append((prompt, stream_chat(base, prompt)))
            print()
        print(f"{'prompt':<56} {'tier':<5} {'tokens':>6} {'TTFT ms':>8} {'tok/s':>6}")
        for prompt, r in rows:
            print(f"{prompt[:55]:<56} {r['tier']:<5} {r['tokens']:>6} {r['ttft_ms']:>8.0f} {r['tok_s']:>6.1f}")
        print("\nTalk to an agent yourself:")
        print("  cascade edge run --port 8081 &")
        print('  python -c "import openai; c = openai.OpenAI(base_url=\'http://127.0.0.1:8081/v1\', '
              "api_key='none'); print(c.chat.completions.create(model='smollm2-135m', "
              "messages=[{'role': 'user', 'content': 'Hi'}]).choices[0].message.content)\"")
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
