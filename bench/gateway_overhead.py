"""Gateway overhead: requests/s and latency of the result-cache hit path and of the quota 429
path, with wrk, against a bare FastAPI app that returns the same stored answer on the same
server stack (the floor any Python gateway stands on), same run.

    .venv/bin/python bench/gateway_overhead.py [--duration 10] [--connections 32]

Needs wrk (apt-get install -y wrk). Starts `cascade cloud serve --both 1` on a free port with a
temporary key database; the model is converted once under $CASCADE_HOME.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import httpx

from cascade.processes import cascade_command, free_port, spawn, stop, wait_healthy

REPO = Path(__file__).resolve().parent.parent
BODY = {"model": "smollm2-135m",
        "messages": [{"role": "user", "content": "Name a primary color."}],
        "max_tokens": 8, "temperature": 0}

BARE_APP = textwrap.dedent('''
    import json, sys
    from fastapi import FastAPI, Request
    from fastapi.responses import Response
    app = FastAPI()
    ANSWER = json.dumps({"id": "chatcmpl-x", "object": "chat.completion", "model": "smollm2-135m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Red."},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33}})
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        await request.json()
        return Response(ANSWER, media_type="application/json")
    if __name__ == "__main__":
        import uvicorn
        uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
                    access_log=False)
''')


def wrk(url: str, key: str, connections: int, duration: int, workdir: Path) -> dict:
    script = workdir / "post.lua"
    script.write_text(textwrap.dedent(f'''
        wrk.method = "POST"
        wrk.body = {json.dumps(json.dumps(BODY))}
        wrk.headers["Content-Type"] = "application/json"
        wrk.headers["Authorization"] = "Bearer {key}"
        statuses = {{}}
        response = function(status, headers, body)
          statuses[status] = (statuses[status] or 0) + 1
        end
    '''))
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency",
                          "-s", str(script), f"{url}/v1/chat/completions"],
                         capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = _ms(re.search(r"50%\s+([\d.]+\w+)", out).group(1))
    p99 = _ms(re.search(r"99%\s+([\d.]+\w+)", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    total = int(re.search(r"(\d+) requests in", out).group(1))
    return {"rps": rps, "p50_ms": p50, "p99_ms": p99, "requests": total,
            "non_2xx": int(non2xx.group(1)) if non2xx else 0}


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(\w+)", text).groups()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=int, default=10)
    p.add_argument("--connections", type=int, default=32)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    env = {"CASCADE_CLOUD_GATEWAY_DB": str(work / "gateway.db")}

    def key(*flags: str) -> str:
        out = subprocess.run(cascade_command("cloud", "keys", "create",
                                             "--db", str(work / "gateway.db"), *flags),
                             env={**os.environ, "OMP_WAIT_POLICY": "passive", **env},
                             capture_output=True, text=True, check=True).stdout
        return out.strip().splitlines()[-1]

    hit_key = key("--tenant", "bench")
    limited_key = key("--tenant", "limited", "--rps", "0.001")
    port, bare_port = free_port(), free_port()
    gateway = spawn(cascade_command("cloud", "serve", "--both", "1", "--prefill", "0",
                                    "--decode", "0", "--port", str(port), "--max-model-len", "1024",
                                    "--kv-cache-bytes", str(64 << 20)), env=env, cwd=REPO)
    (work / "bare.py").write_text(BARE_APP)
    bare = spawn([sys.executable, str(work / "bare.py"), str(bare_port)], env=env)
    try:
        url, bare_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{bare_port}"
        wait_healthy(url, gateway, timeout_s=600, what="gateway")
        wait_healthy(bare_url, bare, timeout_s=600, what="bare FastAPI app", path="/docs")
        for k in (hit_key, limited_key):  # fill the cache; spend the limited key's one request
            r = httpx.post(f"{url}/v1/chat/completions", json=BODY,
                           headers={"authorization": f"Bearer {k}"}, timeout=120)
            print(f"warm-up: {r.status_code} cache={r.headers.get('x-cascade-cache')}",
                  file=sys.stderr)
        rows = []
        for name, target, k in [("bare FastAPI (peer floor)", bare_url, hit_key),
                                ("gateway cache hit", url, hit_key),
                                ("gateway 429 (rps quota)", url, limited_key)]:
            single = wrk(target, k, 1, max(3, args.duration // 2), work)
            loaded = wrk(target, k, args.connections, args.duration, work)
            rows.append((name, loaded, single))
        floor = rows[0][2]["p50_ms"]
        print(f"\nGateway overhead, wrk -t1, {os.cpu_count()} cores shared by wrk and the server")
        print(f"{'path':28s} {'req/s @' + str(args.connections):>11s} {'p50 ms':>8s} "
              f"{'p99 ms':>8s} {'non-2xx':>8s} | {'p50 ms @1':>10s} {'added p50':>10s}")
        for name, loaded, single in rows:
            print(f"{name:28s} {loaded['rps']:11.0f} {loaded['p50_ms']:8.2f} "
                  f"{loaded['p99_ms']:8.2f} {loaded['non_2xx']:8d} | {single['p50_ms']:10.3f} "
                  f"{single['p50_ms'] - floor:+10.3f}")
        print("\nadded p50 = p50 at one connection minus the bare app's; goal: cache hits >= "
              "2,000 req/s, added p50 < 2 ms")
    finally:
        for proc in (gateway, bare):
            stop(proc, timeout_s=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
