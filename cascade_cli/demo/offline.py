"""The demo's offline scene: while the cloud tier is still starting, escalations follow their
offline policy (queued with 202, or answered locally and marked degraded), ``cascade edge queue``
shows the backlog, and once the cloud is up the queue drains."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx

from cascade_cli.demo.chat import stream_chat
from cascade_cli.spawn import cascade_command

OFFLINE = [("Translate 'good morning' into French.", "kiosk-1/till"),
           ("Write one sentence about the sea.", "kiosk-1/till"),
           ("Name a prime number greater than 10.", "kiosk-1/door")]


def offline_scene(edge: str, db: Path, model: str) -> list[tuple[str, str]]:
    """While the cloud is unreachable: requests that must reach it are queued (202 + Location);
    one that may be answered locally is, marked degraded. Returns (prompt, location)."""
    print("\n== the cloud is not reachable yet: escalations follow their offline policy")
    queued = []
    for prompt, session in OFFLINE:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 32,
                "temperature": 0, "cascade": {"mode": "cloud", "offline": "queue", "session": session}}
        r = httpx.post(f"{edge}/v1/chat/completions", json=body, timeout=60)
        print(f"-- app: {prompt}  {{offline: queue, session: {session}}}\n-- {r.status_code} "
              f"{r.headers.get('x-cascade-tier')} ({r.headers.get('x-cascade-reason')}), "
              f"Location: {r.headers.get('location')}")
        if r.status_code == 202:
            queued.append((prompt, r.headers["location"]))
    r = stream_chat(edge, model, "Is the store open today?", {"mode": "cloud", "offline": "local"})
    print(f"-- app: Is the store open today?  {{offline: local}}\n-- {r['tier']} ({r['reason']}"
          f"{', degraded' if r['degraded'] else ''}): {r['text'][:120]}")
    print(f"-- $ cascade edge queue --db {db}")
    backlog = subprocess.run(cascade_command("edge", "queue", "--db", str(db), log_level=None),
                             capture_output=True, text=True)
    print("   " + backlog.stdout.strip().replace("\n", "\n   "))
    return queued


def drain(edge: str, queued: list[tuple[str, str]], timeout_s: float = 300) -> None:
    """Poll GET /v1/requests/{id} until every queued request has an answer."""
    deadline, shown = time.monotonic() + timeout_s, set()
    while len(shown) < len(queued) and time.monotonic() < deadline:
        for _, location in queued:
            if location in shown:
                continue
            item = httpx.get(f"{edge}{location}", timeout=10).json()
            if item["state"] in ("done", "failed", "expired"):
                shown.add(location)
                answer = (item.get("response") or {}).get("choices", [{}])[0].get("message", {}).get("content", "")
                print(f"-- {location}: {item['state']} after {item['attempts']} attempt(s), "
                      f"{item['updated_at'] - item['created_at']:.1f} s queued: {answer.strip()[:100]}")
        time.sleep(0.5)
    if len(shown) < len(queued):
        print(f"-- {len(queued) - len(shown)} queued request(s) not delivered in {timeout_s:.0f} s")
