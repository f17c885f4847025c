"""What a gateway must answer whatever its worker does (tests/integration/test_hostile_*.py): a
well-formed 200, or an OpenAI-style error (a 4xx, 502 or 504; never a 500); a stream that always
ends with ``data: [DONE]`` (an in-band error before it when it failed); and the helpers those
tests share (keys made through the admin API, the gateway's counters)."""

from __future__ import annotations

import json
import uuid

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests import loopback


def sse_events(text: str) -> list:
    """The data of each SSE event, split on "\\n" only (a raw U+2028 is text, not a line end)."""
    out: list = []
    for line in text.split("\n"):
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def is_openai_error(body: object, statuses: tuple[int, ...] = (502, 504)) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and set(err) >= {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and err["message"] != "")


def well_formed(r: httpx.Response, stream: bool) -> tuple[int, str, object]:
    """(status, "ok" | "error", the text or the error) of an answer that must be well formed:
    asserts what every answer must be, whatever the worker did."""
    assert r.status_code in (200, 502, 504), (r.status_code, r.text[:300])
    if r.status_code != 200:
        assert is_openai_error(r.json()), r.text[:300]
        return r.status_code, "error", r.json()["error"]
    if not stream:
        body = r.json()
        assert body["choices"] and isinstance(body.get("usage"), dict), body
        u = body["usage"]
        assert all(isinstance(u[k], int) and u[k] >= 0 for k in ("prompt_tokens", "completion_tokens")), u
        msg = body["choices"][0].get("message") or {}
        return 200, "ok", msg.get("content") if "message" in body["choices"][0] else body["choices"][0]["text"]
    events = sse_events(r.text)
    assert events and events[-1] == "[DONE]", r.text[-300:]
    assert events.count("[DONE]") == 1, r.text[-300:]
    errors = [e for e in events[:-1] if "error" in e]
    if errors:
        assert len(errors) == 1 and events[-2] is errors[0] and is_openai_error(errors[0]), r.text[-500:]
        return 200, "error", errors[0]["error"]
    text = "".join((c.get("delta") or {}).get("content") or c.get("text") or "" for e in events[:-1]
                   for c in e.get("choices") or ())
    return 200, "ok", text


def new_key(gateway_url: str, admin_key: str, **limits) -> str:
    """A key of the admin key's tenant, made through the admin API (no process to start)."""
    r = loopback.post(f"{gateway_url}/v1/admin/keys", json=limits, headers={"authorization": f"Bearer {admin_key}"},
                      timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["key"]


def post(gateway_url: str, key: str, body: dict, endpoint: str = "chat/completions", timeout: float = 20,
         **headers: str) -> httpx.Response:
    h = {"authorization": f"Bearer {key}", **{k.replace("_", "-"): v for k, v in headers.items()}}
    return loopback.post(f"{gateway_url}/v1/{endpoint}", json=body, headers=h, timeout=timeout)


def samples(gateway_url: str, name: str, **labels: str) -> dict[tuple, float]:
    """The gateway's ``name`` samples whose labels include ``labels``: {sorted label items: value}."""
    out = {}
    r = loopback.get(f"{gateway_url}/metrics", timeout=10)
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def total(gateway_url: str, name: str, **labels: str) -> float:
    return sum(samples(gateway_url, name, **labels).values())


def idem() -> str:
    return uuid.uuid4().hex
