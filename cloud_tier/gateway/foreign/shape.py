"""The shape an OpenAI-compatible worker's answer must have before the gateway relays, stores or
converts it: a chunk of a stream and a whole body, for chat and for text completions. Checked
once where the answer comes in (``foreign.proxy``), so that every later reader (the relay, the
result cache, the stream <-> body conversions of ``foreign.answers``, the batch runner) may rely
on it. Fields the gateway does not read are left as they are; the ones it reads must be what the
OpenAI API says (a list of objects, a string or null, ...); each check names what is wrong. Also:
which refusals say the worker itself is unwell (``worker_is_unwell``, what its breaker counts)."""

from __future__ import annotations

from cascade import wire


def _opt(v: object, *types: type) -> bool:
    """``v`` is absent/null or of ``types`` (an int is never a bool)."""
    if v is None:
        return True
    if isinstance(v, bool) and bool not in types:
        return False
    return isinstance(v, types)


def _choice_problem(ch: object, chat: bool, part: str) -> str:
    """What is wrong with one choice (``part``: "delta" in a chunk, "message" in a body), or ""."""
    if not isinstance(ch, dict):
        return "a choice that is not an object"
    index = ch.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 1 << 16:
        return "a choice whose index is not a small integer"
    if not _opt(ch.get("finish_reason"), str):
        return "a finish_reason that is not a string"
    if not _opt(ch.get("logprobs"), dict):
        return "logprobs that are not an object"
    if not chat:
        return "" if _opt(ch.get("text"), str) else "a text that is not a string"
    msg = ch.get(part)
    if msg is None and part == "delta":
        return ""  # a chunk with only a finish_reason
    if not isinstance(msg, dict):
        return f"a {part} that is not an object"
    for name in ("content", "role", "reasoning_content", "reasoning", "refusal"):
        if not _opt(msg.get(name), str):
            return f"a {part}'s {name} that is not a string"
    if not _opt(msg.get("tool_calls"), list):
        return f"a {part}'s tool_calls that are not a list"
    return ""


def _problem(obj: object, chat: bool, part: str) -> str:
    if not isinstance(obj, dict):
        return "not an object"
    choices = obj.get("choices", [] if part == "delta" else None)
    if not isinstance(choices, list):
        return "choices that are not a list"
    if not _opt(obj.get("usage"), dict):
        return "a usage that is not an object"
    for name, types in (("id", (str,)), ("model", (str,)), ("created", (int,))):
        if not _opt(obj.get(name), *types):
            return f"the {name} is of the wrong type"
    for ch in choices:
        if why := _choice_problem(ch, chat, part):
            return why
    return ""


def chunk_problem(chunk: object, chat: bool) -> str:
    """What is wrong with one chunk of a stream ("" when nothing is)."""
    return _problem(chunk, chat, "delta")


def body_problem(body: object, chat: bool) -> str:
    """What is wrong with a whole (not streamed) answer ("" when nothing is)."""
    return _problem(body, chat, "message")


def is_openai_error(content: bytes) -> bool:
    """An error body as the OpenAI API writes it: ``{"error": {"message": "...", ...}}``."""
    try:
        err = wire.loads(content, limit=max(len(content), 1))
    except wire.WireError:
        return False
    err = err.get("error") if isinstance(err, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"] != ""


def worker_is_unwell(status: int, content: bytes) -> bool:
    """Whether a refusal says the worker itself is unwell (counted on its breaker): a 502, 503 or
    504, or a 5xx that is not an OpenAI error body. A 500 (or 501, ...) with one is what this
    request's content did to a worker that serves others (its health check says otherwise), and
    a 408 or 429 is load; neither shuts the worker out for every tenant."""
    return status in (502, 503, 504) or (status >= 500 and not is_openai_error(content))
