"""The demo's app: one streamed chat completion against the edge agent, measured (time to first
token, total), with the tier that answered and why (the X-Cascade-* headers)."""

from __future__ import annotations

import json
import time

import httpx


def stream_chat(base: str, model: str, prompt: str, cascade: dict | None, max_tokens: int = 48) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if cascade:
        body["cascade"] = cascade
    start = time.perf_counter()
    first, text, usage, final = None, [], {}, {}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300) as r:
        headers = r.headers
        if r.status_code != 200:
            r.read()
            message = r.json().get("error", {}).get("message", r.text) if r.text.startswith("{") else r.text
            return {"tier": headers.get("x-cascade-tier", "-"), "reason": f"HTTP {r.status_code}", "degraded": False,
                    "text": message, "tokens": 0, "ttft_ms": float("nan"),
                    "total_ms": (time.perf_counter() - start) * 1000, "confidence": None, "draft": None}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            final = chunk.get("cascade") or final
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    total = time.perf_counter() - start
    return {"tier": headers.get("x-cascade-tier"), "reason": headers.get("x-cascade-reason"),
            "degraded": headers.get("x-cascade-degraded") == "true", "text": "".join(text).strip(),
            "tokens": usage.get("completion_tokens", 0), "ttft_ms": ((first or start + total) - start) * 1000,
            "total_ms": total * 1000, "confidence": final.get("confidence"), "draft": final.get("draft")}
