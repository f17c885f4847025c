"""What the tests of the disaggregated pair as processes share: the pair and its gateways,
prompts no other case shares, the workers' counters, polling, and leaving as a client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import time
from dataclasses import dataclass

import httpx

from cloud_tier.disagg.messages import MAGIC, MessageKind, TransferAck, decode
from tests import loopback
from tests.conftest import Server, create_key, gateway_count

MODEL = "smollm2-135m"


@dataclass
class Cloud:
    prefill: Server
    decode: Server
    gateways: dict[str, Server]
    home: object

    @property
    def workers(self) -> tuple[str, str]:
        return self.prefill.url, self.decode.url


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids no other case shares a prefix with (the prefix cache would skip the work)."""
    return [100 + (seed * 7919 + i * 104729) % 40000 for i in range(n)]


def completion(ids: list[int], max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def counters(cloud: Cloud) -> dict[str, int]:
    p = loopback.get(f"{cloud.prefill.url}/internal/stats", timeout=10).json()["prefill"]
    d = loopback.get(f"{cloud.decode.url}/internal/stats", timeout=10).json()["decode"]
    return {"transfers_ok": p["transfers_ok"], "prefill_cancelled": p["cancelled"], "adopted": d["adopted"]}


def changes(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


async def until(client: httpx.AsyncClient, url: str, what: str, check, timeout_s: float = 60.0) -> None:
    """Poll ``url``'s /internal/stats until ``check(stats)``."""
    deadline = time.monotonic() + timeout_s
    while not check((await client.get(f"{url}/internal/stats")).json()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def settled(gateway: Server, tenant: str, n: int = 1, timeout_s: float = 10.0) -> None:
    """Until the gateway has settled ``n`` requests of ``tenant`` (it counts each once it let go)."""
    deadline = time.monotonic() + timeout_s
    while await asyncio.to_thread(gateway_count, gateway, tenant) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"the gateway did not let go of {tenant}'s request")
        await asyncio.sleep(0.05)


async def ask(client: httpx.AsyncClient, gateway: Server, auth: dict, body: dict) -> str:
    """The gateway's whole answer (the gateway answers once the first token is there); cancel
    the task that runs it to leave."""
    async with client.stream("POST", f"{gateway.url}/v1/completions", headers=auth, json=body) as r:
        assert r.status_code == 200, await r.aread()
        return "".join([line async for line in r.aiter_lines()])


async def leave(task: asyncio.Task) -> None:
    """The client goes away: its connection to the gateway is closed."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def tenant_key(cloud: Cloud, tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {create_key(cloud.home, '--tenant', tenant)}"}


async def until_admission_waiting(gateway: Server, n: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await asyncio.to_thread(gauge, gateway, "cascade_gateway_admission_waiting") != n:
        if time.monotonic() > deadline:
            raise AssertionError(f"the gateway's admission queue did not come to {n}")
        await asyncio.sleep(0.05)


def generated(worker: Server) -> float:
    return gauge(worker, "cascade_worker_generation_tokens_total")


def gauge(server: Server, name: str) -> float:
    """A metric without labels from ``server``'s /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(loopback.get(f"{server.url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"no {name} in {server.url}/metrics")


def frame(kind: MessageKind, body: dict) -> bytes:
    """A frame of the KV wire, written by hand (``messages`` documents the layout)."""
    raw = json.dumps(body).encode()
    return MAGIC + struct.pack(">BI", kind, len(raw)) + raw


def ack_then_closed(s: socket.socket) -> TransferAck:
    """The receiver's ack, once it has closed the connection (socket.timeout if it does not)."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return decode(data)


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")
