"""What a gateway must answer whatever its worker does (tests/integration/test_hostile_*.py): a
well-formed 200, or an OpenAI-style error (a 4xx, 502 or 504; never a 500); a stream that always
ends with ``data: [DONE]`` (an in-band error before it when it failed); and the helpers those
tests share (keys made through the admin API, the gateway's counters)."""

from __future__ import annotations

import json
import time
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


def run_harness(gateway, fake, honest_mode, ask: dict, cases: list[str], script, fails: set[str],
                mid_stream: set[str], stall_s: float, prompt_bound: int) -> None:
    """Every case in turn against ``fake`` (``script(case)``: its mode), each on a new key of the
    admin's tenant ("owner") with a quota: the answer is well formed (an error exactly for the
    ``fails``, in-band exactly for ``mid_stream``; a stall cut by the gateway's own bounds), a
    retry with its Idempotency-Key is answered at once (the stored result, or a new run), and the
    key's next honest request succeeds (its bucket is not in debt). Then: the tenant's counted
    tokens are within ``prompt_bound`` and max_tokens a request, and none was counted a hang-up."""
    stream = ask["stream"]
    before = {k: total(gateway.url, f"cascade_gateway_{k}_tokens_total", tenant="owner")
              for k in ("prompt", "completion")}
    for case in cases:
        key = new_key(gateway.url, gateway.admin, tpm=1000)
        fake.mode = script(case)
        ik = idem()
        t0 = time.monotonic()
        body = {**ask, "temperature": 0.5}  # not cached: every case reaches the worker
        r = post(gateway.url, key, body, idempotency_key=ik)
        status, kind, what = well_formed(r, stream)
        assert time.monotonic() - t0 < stall_s + 1.0, case
        assert kind == ("error" if case in fails else "ok"), (case, status, what)
        if kind == "error":
            assert (status == 200) == (case in mid_stream), (case, status, what)
            assert status != 504 or case.startswith("stall"), (case, what)
        fake.mode = honest_mode()
        again = post(gateway.url, key, body, idempotency_key=ik, timeout=10)
        assert again.status_code == 200, (case, again.text[:300])
        if case not in fails:
            assert again.headers.get("x-cascade-idempotent-replay") == "true", case
        ok = post(gateway.url, key, {**body, "temperature": 0.7})
        assert well_formed(ok, stream)[1] == "ok", (case, ok.status_code, ok.text[:300])
    n = 3 * len(cases)
    spent = {k: total(gateway.url, f"cascade_gateway_{k}_tokens_total", tenant="owner") - v for k, v in before.items()}
    assert spent["completion"] <= ask["max_tokens"] * n and spent["prompt"] <= prompt_bound * n, spent
    outcomes = samples(gateway.url, "cascade_gateway_requests_total", tenant="owner")
    assert not any(dict(k)["outcome"] == "499" for k, v in outcomes.items() if v), outcomes
    refused = {dict(k)["reason"] for k, v in samples(gateway.url, "cascade_gateway_worker_usage_refused_total").items()
               if v}
    assert refused == {"negative", "over_bound", "not_integer"}, refused
