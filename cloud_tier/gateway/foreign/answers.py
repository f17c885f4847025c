"""What the gateway reads of an OpenAI-compatible worker's answers without changing them: the
prompt's text (for prefix routing), a token estimate (for quotas before the worker's own usage
is known), the usage, a cache key, and the two shapes a stored answer is replayed in (the SSE
chunks of a stream, one JSON body)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

CHARS_PER_TOKEN = 4  # the usual estimate (GIE's too), only until the worker's usage says


def prompt_text(endpoint: str, body: dict) -> str:
    """The prompt as one string: a chat's messages as role + text in order, a completion's prompt."""
    if endpoint == "chat":
        parts = []
        for m in body.get("messages") or ():
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts: their text
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role', '')}\n{content if isinstance(content, str) else ''}\n")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return " ".join(str(p) for p in prompt)
    return prompt if isinstance(prompt, str) else ""


def estimate_tokens(text: str) -> int:
    return max(1, len(text) // CHARS_PER_TOKEN)


def max_tokens_of(body: dict) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v
    return None


def usage_of(obj: dict) -> tuple[object, object] | None:
    """(prompt_tokens, completion_tokens) of a chunk or a body that carries usage, as the worker
    wrote them (checked by ``workers.usage.checked``), else None."""
    u = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(u, dict):
        return None
    return u.get("prompt_tokens"), u.get("completion_tokens")


def text_and_finish(obj: dict) -> tuple[int, str | None]:
    """The characters of answer text in a chunk (a delta's or a choice's text) or a body (its
    messages), for an estimate of the tokens when the worker gives no usage; and the last
    finish_reason it names (None: none). One walk, no generator: it runs once per relayed chunk."""
    n, reason = 0, None
    choices = obj.get("choices")
    if not choices:
        return 0, None
    for c in choices:
        if type(c) is not dict:
            continue
        for part in (c.get("delta"), c.get("message")):
            if type(part) is dict:
                v = part.get("content")
                if type(v) is str:
                    n += len(v)
                v = part.get("reasoning_content")
                if type(v) is str:
                    n += len(v)
        v = c.get("text")
        if type(v) is str:
            n += len(v)
        v = c.get("finish_reason")
        if type(v) is str:
            reason = v
    return n, reason


def is_deterministic(body: dict) -> bool:
    """Only greedy (temperature 0) or seeded sampling gives the same answer twice."""
    t, seed = body.get("temperature"), body.get("seed")
    n = body.get("n", 1)
    return (t == 0 or (isinstance(seed, int) and not isinstance(seed, bool))) and n in (1, None)


def cache_key(tenant: str, endpoint: str, body: dict) -> str | None:
    """sha256 of the request as the worker gets it, less how it is delivered (stream, its
    options, the user field), per tenant; None when the answer is not deterministic."""
    if not is_deterministic(body):
        return None
    core = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "user")}
    canonical = json.dumps({"tenant": tenant, "endpoint": endpoint, "body": core}, sort_keys=True,
                           separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _str(v: object) -> str:
    return v if isinstance(v, str) else ""


def _index(ch: dict) -> int:
    i = ch.get("index", 0)
    return i if isinstance(i, int) and not isinstance(i, bool) else 0


def _dicts(items: object) -> list[dict]:
    return [x for x in items if isinstance(x, dict)] if isinstance(items, list) else []


def chunks_to_response(chunks: list[dict], endpoint: str) -> dict[str, Any]:
    """A stream's chunks as the one JSON body the same request, not streamed, would get. The
    chunks were checked when they came (``foreign.shape``); what is not as the API says is skipped
    here all the same, so that no stored answer can make this raise."""
    chunks = _dicts(chunks)
    first = next((c for c in chunks if c.get("choices")), chunks[0] if chunks else {})
    choices: dict[int, dict] = {}
    usage = None
    for c in chunks:
        usage = c.get("usage") if isinstance(c.get("usage"), dict) else usage
        for ch in _dicts(c.get("choices")):
            i = _index(ch)
            acc = choices.setdefault(i, {"index": i, "text": "", "role": None, "finish_reason": None,
                                         "logprobs": None})
            delta = ch.get("delta") if isinstance(ch.get("delta"), dict) else {}
            acc["text"] += _str(delta.get("content")) if endpoint == "chat" else _str(ch.get("text"))
            acc["role"] = _str(delta.get("role")) or acc["role"]
            acc["finish_reason"] = _str(ch.get("finish_reason")) or acc["finish_reason"]
            lp = ch.get("logprobs")
            if isinstance(lp, dict):
                acc["logprobs"] = _merge_logprobs(acc["logprobs"], lp)
    out_choices = []
    for i in sorted(choices):
        acc = choices[i]
        if endpoint == "chat":
            out_choices.append({"index": i, "message": {"role": acc["role"] or "assistant", "content": acc["text"]},
                                "logprobs": acc["logprobs"], "finish_reason": acc["finish_reason"]})
        else:
            out_choices.append({"index": i, "text": acc["text"], "logprobs": acc["logprobs"],
                                "finish_reason": acc["finish_reason"]})
    body = {"id": first.get("id"), "object": "chat.completion" if endpoint == "chat" else "text_completion",
            "created": first.get("created"), "model": first.get("model"), "choices": out_choices}
    if usage is not None:
        body["usage"] = usage
    return body


def _merge_logprobs(acc: dict | None, lp: dict) -> dict:
    if acc is None:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in lp.items()}
    for k, v in lp.items():
        if isinstance(v, list) and isinstance(acc.get(k), list):
            acc[k].extend(v)
    return acc


def response_to_chunks(body: dict, endpoint: str) -> list[dict]:
    """One JSON body as the stream of chunks a streamed request would get (one per choice, then
    the usage chunk); like ``chunks_to_response``, never raising on a body not as the API says."""
    body = body if isinstance(body, dict) else {}
    obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
    base = {"id": body.get("id"), "object": obj, "created": body.get("created"), "model": body.get("model")}
    chunks = []
    for ch in _dicts(body.get("choices")):
        lp = ch.get("logprobs") if isinstance(ch.get("logprobs"), dict) else None
        finish = ch.get("finish_reason") if isinstance(ch.get("finish_reason"), str) else None
        if endpoint == "chat":
            msg = ch.get("message") if isinstance(ch.get("message"), dict) else {}
            c = {"index": _index(ch), "delta": {"role": _str(msg.get("role")) or "assistant",
                                                "content": _str(msg.get("content"))},
                 "logprobs": lp, "finish_reason": finish}
        else:
            c = {"index": _index(ch), "text": _str(ch.get("text")), "logprobs": lp, "finish_reason": finish}
        chunks.append({**base, "choices": [c]})
    if isinstance(body.get("usage"), dict):
        chunks.append({**base, "choices": [], "usage": body["usage"]})
    return chunks
