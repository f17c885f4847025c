"""Gateway overhead: requests/s and latency of the result-cache hit path and of the quota 429
path, with wrk, against a bare FastAPI app that returns the same stored answer on the same
server stack (the floor any Python gateway stands on), same run; the gateway with its state
embedded (SQLite keys, quotas and cache in the process) and on PostgreSQL + Redis.

    .venv/bin/python bench/gateway_overhead.py [--duration 10] [--connections 32]

Needs wrk (apt-get install -y wrk), PostgreSQL and redis-server (started here, on free ports with
temporary data: testkit.devservers). Starts one worker (`cascade cloud worker`) and two
`cascade cloud serve --workers URL` gateways in front of it, one with `--db FILE`, one with
`--db postgresql://... --redis redis://...`; the model is converted once under $CASCADE_HOME.
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

from cascade.processes import free_port, spawn, stop, wait_healthy
from cascade_cli.spawn import cascade_command
from testkit.devservers import MissingServer, Postgres, Redis

# the figures here are about SmolLM2-135M (the defaults are the Qwen tier pair): every server started here serves it
os.environ.setdefault("CASCADE_EDGE_MODEL_NAME", "smollm2-135m")
os.environ.setdefault("CASCADE_CLOUD_ENGINE_MODEL", "smollm2-135m")

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
    procs: list = []
    servers: list = []
    try:
        try:
            servers.append(pg := Postgres())
            servers.append(rd := Redis())
        except MissingServer as e:
            print(f"gateway_overhead: {e}", file=sys.stderr)
            return 2
        worker_port, bare_port = free_port(), free_port()
        worker = spawn(cascade_command("cloud", "worker", "--role", "both", "--port", str(worker_port),
                                       "--max-model-len", "1024", "--kv-cache-bytes", str(64 << 20)),
                       log=work / "worker.log", cwd=REPO)
        procs.append(worker)
        (work / "bare.py").write_text(BARE_APP)
        procs.append(bare := spawn([sys.executable, str(work / "bare.py"), str(bare_port)]))
        worker_url, bare_url = f"http://127.0.0.1:{worker_port}", f"http://127.0.0.1:{bare_port}"
        wait_healthy(worker_url, worker, timeout_s=600, what="worker", log=work / "worker.log")
        wait_healthy(bare_url, bare, timeout_s=60, what="bare FastAPI app", path="/docs")
        # the same gateway twice in front of the same worker: its state embedded, and on PostgreSQL + Redis
        gateways = []
        for name, flags in [("embedded", ["--db", str(work / "gateway.db")]),
                            ("PG+Redis", ["--db", pg.dsn, "--redis", rd.url])]:
            hit_key = create_key(flags[1], "--tenant", "bench")
            limited_key = create_key(flags[1], "--tenant", "limited", "--rps", "0.001")
            port = free_port()
            log = work / f"gateway-{len(gateways)}.log"
            gw = spawn(cascade_command("cloud", "serve", "--workers", worker_url, "--port", str(port), *flags),
                       log=log, cwd=REPO)
            procs.append(gw)
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, gw, timeout_s=120, what=f"gateway ({name})", log=log)
            for k in (hit_key, limited_key):  # fill the cache; spend the limited key's one request
                r = httpx.post(f"{url}/v1/chat/completions", json=BODY,
                               headers={"authorization": f"Bearer {k}"}, timeout=120)
                print(f"warm-up {name}: {r.status_code} cache={r.headers.get('x-cascade-cache')}", file=sys.stderr)
            gateways.append((name, url, hit_key, limited_key))
        plan = [("bare FastAPI (peer floor)", bare_url, gateways[0][2])]
        for name, url, hit_key, limited_key in gateways:
            plan += [(f"gateway {name}: cache hit", url, hit_key), (f"gateway {name}: 429 rps", url, limited_key)]
        rows = []
        for name, target, k in plan:
            single = wrk(target, k, 1, max(3, args.duration // 2), work)
            loaded = wrk(target, k, args.connections, args.duration, work)
            rows.append((name, loaded, single))
        floor, floor_rps = rows[0][2]["p50_ms"], rows[0][1]["rps"]
        print(f"\nGateway overhead, wrk -t1, {os.cpu_count()} cores shared by wrk and the servers")
        print(f"{'path':30s} {'req/s @' + str(args.connections):>11s} {'x bare':>7s} {'p50 ms':>8s} "
              f"{'p99 ms':>8s} {'non-2xx':>8s} | {'p50 ms @1':>10s} {'added p50':>10s}")
        for name, loaded, single in rows:
            print(f"{name:30s} {loaded['rps']:11.0f} {loaded['rps'] / floor_rps:7.2f} {loaded['p50_ms']:8.2f} "
                  f"{loaded['p99_ms']:8.2f} {loaded['non_2xx']:8d} | {single['p50_ms']:10.3f} "
                  f"{single['p50_ms'] - floor:+10.3f}")
        print("\nx bare = req/s over the bare app's; added p50 = p50 at one connection minus the bare app's. "
              "Goal: cache hits >= 0.7x bare, added p50 < 2 ms")
    finally:
        for proc in reversed(procs):
            stop(proc, timeout_s=30)
        for server in servers:
            server.stop()
    return 0


def create_key(db: str, *flags: str) -> str:
    out = subprocess.run(cascade_command("cloud", "keys", "create", "--db", db, *flags),
                         env={**os.environ, "OMP_WAIT_POLICY": "passive"}, capture_output=True, text=True,
                         check=True).stdout
    return out.strip().splitlines()[-1]


if __name__ == "__main__":
    sys.exit(main())
