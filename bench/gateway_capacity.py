"""The inputs of the capacity model (docs/scale.md), measured on this machine: the gateway's CPU
per streamed request as a fixed part plus a part per relayed chunk, its CPU per result-cache hit,
and its idle CPU per worker (health and /metrics polling). The gateway is `cascade cloud serve
--workers URL --worker-type vllm` in front of bench/synthetic_worker.py (vLLM's chunks and
/metrics, at ``--tpot-ms`` a token, costing the gateway nothing of its own); the gateway's CPU is
read from /proc before and after each phase, its idle rate taken off.

    .venv/bin/python bench/gateway_capacity.py [--requests 200] [--concurrency 16] [--lengths 16,64,200]
        [--tpot-ms 10] [--out capacity.json]

With ``--redis URL --db postgresql://...`` the gateway's state is there instead of embedded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from cascade.processes import free_port, spawn, stop, wait_healthy
from cascade_cli.spawn import cascade_command

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"


def cpu_seconds(pid: int) -> float:
    return sum(cpu_split(pid))


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def switches(pid: int) -> int:
    """Voluntary context switches of ``pid`` so far: each one an event-loop sleep and wake."""
    for line in Path(f"/proc/{pid}/status").read_text().split("\n"):
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    return 0


async def load(url: str, key: str, body: dict, n: int, concurrency: int) -> tuple[int, int]:
    """``n`` requests, ``concurrency`` at a time, each read to its end: (ok, chunks seen)."""
    ok = chunks = 0
    left = iter(range(n))
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    payload = json.dumps(body).encode()

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal ok, chunks
        for _ in left:
            async with session.post(f"{url}/v1/chat/completions", data=payload, headers=headers) as r:
                data = await r.read()
                if r.status == 200:
                    ok += 1
                    chunks += data.count(b"\ndata: ") + data.startswith(b"data: ")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(one(session) for _ in range(concurrency)))
    return ok, chunks


def redis_stats(url: str) -> dict[str, tuple[int, int]]:
    """Redis' own count of calls and CPU microseconds per command (INFO commandstats)."""
    import redis

    stats = redis.Redis.from_url(url).info("commandstats")
    return {k: (v["calls"], v["usec"]) for k, v in stats.items()}


def redis_used(url: str, before: dict | None) -> tuple[int, int] | None:
    """(commands, CPU microseconds) Redis spent since ``before`` (scripts' own calls included)."""
    if before is None:
        return None
    after = redis_stats(url)
    calls = sum(c for k, (c, _) in after.items()) - sum(c for c, _ in before.values())
    usec = sum(u for k, (_, u) in after.items()) - sum(u for _, u in before.values())
    return calls, usec


def phase(pid: int, idle_per_s: float, work) -> tuple[float, float]:
    """(the gateway's CPU seconds for ``work`` less its idle rate over the time it took, seconds);
    prints its user/system split and its event loop's wakes."""
    (u0, s0), w0, t0 = cpu_split(pid), switches(pid), time.monotonic()
    work()
    wall = time.monotonic() - t0
    (u1, s1), w1 = cpu_split(pid), switches(pid)
    print(f"    user {u1 - u0:.2f} s, system {s1 - s0:.2f} s, {w1 - w0} wakes", flush=True)
    return u1 + s1 - u0 - s0 - idle_per_s * wall, wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--lengths", default="16,64,200", help="output tokens (streamed chunks) per request")
    p.add_argument("--tpot-ms", type=float, default=10.0)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--redis", default="")
    p.add_argument("--db", default="")
    p.add_argument("--pg-redis", action="store_true",
                   help="start PostgreSQL and Redis here (testkit.devservers) and keep the gateway's state there")
    p.add_argument("--out")
    p.add_argument("--bare", action="store_true", help="also the same streams through bench/bare_relay.py (the peer)")
    p.add_argument("--profile", help="py-spy the gateway through the streamed phases; collapsed stacks here")
    args = p.parse_args()
    servers = []
    if args.pg_redis:
        from testkit.devservers import Postgres, Redis

        servers = [Postgres(), Redis()]
        args.db, args.redis = servers[0].dsn, servers[1].url
    work = Path(tempfile.mkdtemp(prefix="gateway-capacity-"))
    wport, gport = free_port(), free_port()
    worker = spawn([sys.executable, str(REPO / "bench/synthetic_worker.py"), "--port", str(wport), "--tpot-ms",
                    str(args.tpot_ms)], log=work / "worker.log", cwd=REPO)
    gateway = bare = None
    try:
        wait_healthy(f"http://127.0.0.1:{wport}", worker, 60, "synthetic worker", path="/health")
        env = {"CASCADE_HOME": str(work), "CASCADE_CLOUD_GATEWAY_DB": args.db or str(work / "gateway.db"),
               "CASCADE_CLOUD_GATEWAY_WORKER_MAX_WAITING": "100000", "CASCADE_CLOUD_GATEWAY_MAX_QUEUE": "100000"}
        if args.redis:
            env["CASCADE_CLOUD_GATEWAY_REDIS"] = args.redis
        key = subprocess.run(cascade_command("cloud", "keys", "create", "--tenant", "bench"), env={**os.environ, **env},
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        gateway = spawn(cascade_command("cloud", "serve", "--port", str(gport), "--workers",
                                        f"http://127.0.0.1:{wport}", "--worker-type", "vllm"),
                        env=env, log=work / "gateway.log", cwd=REPO)
        url = f"http://127.0.0.1:{gport}"
        wait_healthy(url, gateway, 120, "gateway", log=work / "gateway.log")
        if args.bare:
            bport = free_port()
            bare = spawn([sys.executable, str(REPO / "bench/bare_relay.py"), "--port", str(bport), "--worker",
                          f"http://127.0.0.1:{wport}"], log=work / "bare.log", cwd=REPO)
            bare_url = f"http://127.0.0.1:{bport}"
            wait_healthy(bare_url, bare, 60, "bare relay", path="/health")
        time.sleep(2.0)
        c0 = cpu_seconds(gateway.pid)
        time.sleep(args.idle_s)
        idle = (cpu_seconds(gateway.pid) - c0) / args.idle_s
        print(f"idle: {1000 * idle:.2f} ms CPU per second (one worker's health and /metrics polling)", flush=True)
        result = {"idle_cpu_ms_per_s_one_worker": 1000 * idle, "streams": {}}
        spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(gateway.pid),
                                "--rate", "200", "--format", "raw", "--output", args.profile, "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if args.profile else None
        base = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}], "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.7}
        for n in [int(x) for x in args.lengths.split(",")]:
            body = {**base, "max_tokens": n}
            asyncio.run(load(url, key, body, args.concurrency, args.concurrency))  # warm-up
            out = {}

            def run(b=body, out=out):
                out["ok"], out["chunks"] = asyncio.run(load(url, key, b, args.requests, args.concurrency))

            before_redis = redis_stats(args.redis) if args.redis else None
            cpu, wall = phase(gateway.pid, idle, run)
            per = 1000 * cpu / max(out["ok"], 1)
            print(f"{n:>4} tokens streamed: {out['ok']} ok in {wall:.1f} s, gateway CPU {per:.2f} ms per request "
                  f"({1000 * per / max(n, 1):.1f} us per token)", flush=True)
            result["streams"][n] = {"ok": out["ok"], "cpu_ms_per_request": per, "wall_s": wall}
            if args.redis and (used := redis_used(args.redis, before_redis)):
                calls, usec = used
                result["streams"][n]["redis"] = {"calls_per_request": calls / out["ok"],
                                                 "redis_cpu_us_per_request": usec / out["ok"]}
                print(f"      Redis: {calls / out['ok']:.1f} commands and {usec / out['ok']:.0f} us of its CPU per "
                      "request", flush=True)
            if bare is not None:  # the peer: the same streams through a relay that only moves bytes
                cpu, wall = phase(bare.pid, 0.0, lambda b=body: asyncio.run(
                    load(bare_url, key, b, args.requests, args.concurrency)))
                result["streams"][n]["bare_cpu_ms_per_request"] = bare_per = 1000 * cpu / args.requests
                print(f"      bare relay (bench/bare_relay.py): {bare_per:.2f} ms per request; the gateway "
                      f"{per / bare_per:.2f}x", flush=True)
        lengths = sorted(result["streams"])
        if len(lengths) >= 2:
            lo, hi = lengths[0], lengths[-1]
            per_chunk = (result["streams"][hi]["cpu_ms_per_request"] - result["streams"][lo]["cpu_ms_per_request"]) / (
                hi - lo)
            fixed = result["streams"][lo]["cpu_ms_per_request"] - per_chunk * lo
            result["fit"] = {"fixed_ms": fixed, "per_chunk_ms": per_chunk}
            print(f"fit: {fixed:.3f} ms + {1000 * per_chunk:.1f} us x tokens per streamed request", flush=True)
        if spy is not None:
            spy.send_signal(2)
            spy.wait(60)
        hit = {**base, "stream": False, "temperature": 0, "max_tokens": 16}
        hit.pop("stream_options")
        asyncio.run(load(url, key, hit, 1, 1))  # stored
        out = {}

        def hits() -> None:
            out["ok"], out["chunks"] = asyncio.run(load(url, key, hit, args.requests * 5, args.concurrency))

        cpu, wall = phase(gateway.pid, idle, hits)
        result["cache_hit_cpu_ms"] = 1000 * cpu / max(out["ok"], 1)
        print(f"cache hits: {out['ok']} in {wall:.1f} s, gateway CPU {result['cache_hit_cpu_ms']:.3f} ms per hit",
              flush=True)
    finally:
        for proc in (gateway, bare):
            if proc is not None:
                stop(proc)
        stop(worker)
        for server in servers:
            server.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
