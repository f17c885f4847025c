"""The disaggregated pair as processes: a prefill worker and a decode worker (one thread each,
64-token prefill chunks, so a long prompt takes seconds) and a gateway per KV transport in front
of them.

A client that goes away stops its request at every stage of the path, client -> gateway ->
decode worker -> prefill worker -> engine: after each case every worker's engine holds nothing,
every KV block is free and no shared-memory segment is left. And the decode worker's KV
receiver takes only the transfers it expects: a forged header is refused before anything is
allocated for it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time

import httpx
import pytest

from cloud_tier.disagg.messages import MessageKind
from tests import loopback
from tests.conftest import Server
from tests.integration.pair_helpers import (
    MODEL,
    Cloud,
    ack_then_closed,
    ask,
    changes,
    completion,
    counters,
    frame,
    generated,
    leave,
    prompt,
    rss,
    settled,
    tenant_key,
    until,
    until_admission_waiting,
)
from tests.integration.worker_accounting import shm_segments, wait_idle

TRANSPORTS = ["tcp", "shm"]
LONG = 600  # prompt tokens: ~38 KV blocks, prefilled in 10 chunks (seconds on one thread)
MEDIUM = 400  # ~25 blocks, ~18 MiB of float32 KV: more than a stopped receiver's socket takes


def _worker(home, role: str) -> Server:
    return Server(home, ["cloud", "worker"], "--role", role, "--model", MODEL, "--max-model-len", "1024",
                  "--kv-cache-bytes", str(128 << 20), "--max-num-batched-tokens", "64", "--threads", "1")


@pytest.fixture(scope="module")
def cloud(engine_home, smollm2_engine):  # the engine fixture has converted the model already
    servers: list[Server] = []
    try:
        prefill, decode = _worker(engine_home, "prefill"), _worker(engine_home, "decode")
        servers += [prefill, decode]
        prefill.wait_healthy(), decode.wait_healthy()
        gateways = {}
        for transport in TRANSPORTS:
            gateways[transport] = Server(engine_home, ["cloud", "serve"], "--workers", f"{prefill.url},{decode.url}",
                                         "--kv-transport", transport)
            servers.append(gateways[transport])
        for g in gateways.values():
            g.wait_healthy(120)
        yield Cloud(prefill, decode, gateways, engine_home)
    finally:
        for s in reversed(servers):
            s.stop()


@pytest.fixture
def ready(cloud):
    """Every gateway sees both workers healthy (a case may have stopped one), all idle."""
    deadline = time.monotonic() + 30
    for g in cloud.gateways.values():
        while not all(w["healthy"] for w in loopback.get(f"{g.url}/healthz", timeout=10).json()["workers"].values()):
            assert time.monotonic() < deadline, "the gateway does not see its workers healthy again"
            time.sleep(0.1)
    wait_idle(*cloud.workers)
    return cloud


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_client_gone_during_prefill_stops_the_prefill_and_nothing_is_adopted(ready, transport):
    cloud, tenant = ready, f"gone-in-prefill-{transport}"
    gateway, auth = cloud.gateways[transport], tenant_key(ready, tenant)
    before, shm = counters(cloud), shm_segments()

    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            body = completion(prompt(LONG, 1 + TRANSPORTS.index(transport)), 8, True)
            client = asyncio.create_task(ask(c, gateway, auth, body))
            await until(c, cloud.prefill.url, "the prefill to start", lambda s: s["engine"]["running"] == 1)
            await leave(client)
            # its prefill (seconds more) stops, on a worker the client never talked to
            await until(c, cloud.prefill.url, "the prefill to stop", lambda s: s["engine"]["running"] == 0,
                        timeout_s=3)

    asyncio.run(go())
    wait_idle(*cloud.workers, shm_before=shm)
    assert changes(before, counters(cloud)) == {"transfers_ok": 0, "prefill_cancelled": 1, "adopted": 0}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_client_gone_during_the_kv_transfer_drops_the_transfer(ready, transport):
    """The decode worker is stopped (SIGSTOP) while the prompt is prefilled, so the KV transfer
    waits on it; the client leaves; the decode worker resumes to a transfer whose caller is gone."""
    cloud, tenant = ready, f"gone-in-transfer-{transport}"
    gateway, auth = cloud.gateways[transport], tenant_key(ready, tenant)
    decode_pid = loopback.get(f"{cloud.decode.url}/healthz").json()["pid"]
    before, shm = counters(cloud), shm_segments()

    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            stopped = False
            try:
                body = completion(prompt(MEDIUM, 3 + TRANSPORTS.index(transport)), 8, True)
                client = asyncio.create_task(ask(c, gateway, auth, body))
                await until(c, cloud.prefill.url, "the prefill to start", lambda s: s["engine"]["running"] == 1)
                os.kill(decode_pid, signal.SIGSTOP)
                stopped = True
                await until(c, cloud.prefill.url, "the prefilled KV to be on its way",
                            lambda s: s["engine"]["held"] == 1)
                await leave(client)
                await settled(gateway, tenant)  # the gateway has closed its call to the (stopped) decode worker
            finally:
                if stopped:
                    os.kill(decode_pid, signal.SIGCONT)

    asyncio.run(go())
    wait_idle(*cloud.workers, shm_before=shm)
    assert changes(before, counters(cloud))["adopted"] == 0
    assert changes(before, counters(cloud))["transfers_ok"] == 0


def test_client_gone_before_the_first_byte_while_queued_never_runs(ready):
    """A non-streamed request queued on the prefill worker behind a long prompt: its client
    leaves before any byte of the answer; it never runs, and the one ahead of it is served."""
    cloud = ready
    gateway = cloud.gateways["tcp"]
    ahead, queued = tenant_key(ready, "queued-ahead"), tenant_key(ready, "queued-gone")
    before, shm = counters(cloud), shm_segments()

    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            first = asyncio.create_task(ask(c, gateway, ahead, completion(prompt(LONG, 5), 4, True)))
            await until(c, cloud.prefill.url, "the first prefill", lambda s: s["engine"]["running"] == 1)
            # a long prompt too (> 256 tokens): a short one would run beside the first in the short lane
            second = asyncio.create_task(c.post(f"{gateway.url}/v1/completions", headers=queued,
                                                json=completion(prompt(300, 6), 4, False)))
            await until(c, cloud.prefill.url, "the second to queue", lambda s: s["engine"]["waiting"] == 1)
            await leave(second)
            await until(c, cloud.prefill.url, "the queued request to go", lambda s: s["engine"]["waiting"] == 0,
                        timeout_s=3)
            body = await first
            assert '"finish_reason":"length"' in body and "[DONE]" in body

    asyncio.run(go())
    wait_idle(*cloud.workers, shm_before=shm)
    assert changes(before, counters(cloud)) == {"transfers_ok": 1, "prefill_cancelled": 1, "adopted": 1}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_client_gone_mid_stream_stops_the_decode(ready, transport):
    cloud, tenant = ready, f"gone-mid-stream-{transport}"
    gateway, auth = cloud.gateways[transport], tenant_key(ready, tenant)
    before, shm = counters(cloud), shm_segments()
    tokens_before = generated(cloud.decode)

    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            async with c.stream("POST", f"{gateway.url}/v1/completions", headers=auth,
                                json=completion(prompt(60, 7 + TRANSPORTS.index(transport)), 600, True)) as r:
                chunks = 0
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: {")
                    if chunks == 4:
                        break
            await until(c, cloud.decode.url, "the decode to stop", lambda s: s["engine"]["running"] == 0,
                        timeout_s=3)

    asyncio.run(go())
    wait_idle(*cloud.workers, shm_before=shm)
    assert changes(before, counters(cloud)) == {"transfers_ok": 1, "prefill_cancelled": 0, "adopted": 1}
    assert generated(cloud.decode) - tokens_before < 200  # of the 600 asked for


def test_client_gone_while_waiting_for_admission_is_let_go_at_once(ready):
    """Two requests commit 64 KV blocks each on the decode worker (163 under its watermark); a
    third waits in the gateway's admission queue, and its client leaves: the gateway lets it go
    then, not when room comes (or its time-to-first-token objective passes) to run it for nobody."""
    cloud = ready
    gateway = cloud.gateways["tcp"]
    auth = tenant_key(ready, "admission-gone")
    before, shm = counters(cloud), shm_segments()

    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            holders = [asyncio.create_task(ask(c, gateway, auth, completion(prompt(24, 20 + i), 1000, True)))
                       for i in range(2)]
            await until(c, cloud.decode.url, "both to run", lambda s: s["engine"]["running"] == 2)
            queued = asyncio.create_task(c.post(f"{gateway.url}/v1/completions", headers=auth,
                                                json=completion(prompt(24, 22), 1000, False)))
            await until_admission_waiting(gateway, 1)
            await leave(queued)
            try:
                await until_admission_waiting(gateway, 0, timeout_s=3)
            finally:
                for h in holders:
                    await leave(h)

    asyncio.run(go())
    wait_idle(*cloud.workers, shm_before=shm)
    assert changes(before, counters(cloud))["adopted"] == 2


def test_prefill_worker_releases_the_held_kv_when_its_caller_leaves_mid_transfer(ready):
    """The prefill worker's own caller (here the test, as a decode worker would) leaves while
    the KV transfer waits on a receiver that takes nothing: the blocks are freed at once, not
    after the transfer's 120 s timeout."""
    cloud = ready
    before = counters(cloud)

    async def go():
        async def take_nothing(reader, writer):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

        sink = await asyncio.start_server(take_nothing, "127.0.0.1", 0)
        target = f"127.0.0.1:{sink.sockets[0].getsockname()[1]}"
        try:
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"kv_target": target, "transport": "tcp",
                        "record": {"request_id": "held-then-gone", "prompt_token_ids": prompt(MEDIUM, 9),
                                   "sampling": {"max_tokens": 4, "temperature": 0}}}
                call = asyncio.create_task(c.post(f"{cloud.prefill.url}/internal/prefill", json=body))
                await until(c, cloud.prefill.url, "the KV to be held for the transfer",
                            lambda s: s["engine"]["held"] == 1)
                await leave(call)
                await until(c, cloud.prefill.url, "the held KV to be released", lambda s: s["engine"]["held"] == 0,
                            timeout_s=3)
        finally:
            sink.close()

    asyncio.run(go())
    wait_idle(*cloud.workers)
    assert changes(before, counters(cloud))["prefill_cancelled"] == 1


def test_a_forged_kv_header_is_refused_before_anything_is_allocated(ready, smollm2_engine):
    """Two connections each send a well-formed header for a 1 GiB payload of a request the
    worker does not expect (a guessed token), as the issue's did: each is answered and closed at
    once, the worker's memory does not grow, and a real request is served afterwards."""
    cloud = ready
    health = loopback.get(f"{cloud.decode.url}/healthz").json()
    host, port = health["kv_address"].rsplit(":", 1)
    rss_before = rss(health["pid"])
    forged = frame(MessageKind.TRANSFER_HEADER, {
        "request_id": "forged", "model_identity": smollm2_engine.model_identity, "dtype": "float32",
        "shape": [1 << 28], "nbytes": 1 << 30, "checksum": "00000000", "transport": "tcp", "shm_name": None,
        "token": "guessed",
        "record": {"request_id": "forged", "prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 4}}})
    connections = [socket.create_connection((host, int(port)), timeout=5) for _ in range(2)]
    try:
        for s in connections:
            s.sendall(forged)  # and then nothing: the payload never comes
        acks = [ack_then_closed(s) for s in connections]
    finally:
        for s in connections:
            s.close()
    assert [(a.ok, a.code) for a in acks] == [(False, "unknown_request")] * 2
    assert rss(health["pid"]) - rss_before < 64 << 20
    auth = tenant_key(cloud, "after-forgery")
    r = loopback.post(f"{cloud.gateways['tcp'].url}/v1/completions", headers=auth, timeout=120,
                   json=completion(prompt(20, 11), 4, False))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    wait_idle(*cloud.workers)




def test_a_json_schema_answer_is_prefilled_and_decoded_within_its_grammar(ready):
    """response_format through the gateway: the prefill worker samples the first token under the mask and
    the decode worker goes on within the grammar; a grammar the decode worker cannot compile is its 400
    before any prefill worker is asked."""
    import json

    cloud = ready
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "country": {"enum": ["France", "Spain"]}},
              "required": ["city", "country"], "additionalProperties": False}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Which city is the capital of France?"}],
            "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}}}
    before = counters(cloud)
    r = loopback.post(f"{cloud.gateways['tcp'].url}/v1/chat/completions", headers=tenant_key(cloud, "guided-pd"),
                      json=body, timeout=120)
    assert r.status_code == 200, r.text
    answer = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(answer) == {"city", "country"} and answer["country"] in ("France", "Spain")
    assert changes(before, counters(cloud))["adopted"] == 1
    record = {"request_id": "", "prompt_token_ids": prompt(20, 3), "sampling": {"max_tokens": 4,
                                                                                 "guided": "start: missing_rule"}}
    bad = loopback.post(f"{cloud.decode.url}/internal/generate", timeout=60,
                        json={"record": record, "prefill_url": cloud.prefill.url})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_schema", bad.text
    assert changes(before, counters(cloud))["transfers_ok"] == 1  # the refused one never reached the prefill
    wait_idle(*cloud.workers)
