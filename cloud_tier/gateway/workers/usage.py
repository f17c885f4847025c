"""A worker's word on what a request used, checked before it touches money (budgets), a token
bucket (quotas), a Prometheus counter or a stored result: the one place a worker's usage numbers
are read. Each number must be an integer (not a bool, a float or a string) from 0 up to what the
request could have used (``UsageBounds``): a number over its bound is clamped to it, anything
else refuses the usage (the gateway's own count stands in); either way the reason is counted
(``cascade_gateway_worker_usage_refused_total``)."""

from __future__ import annotations

from dataclasses import dataclass

UNSTATED_CONTEXT = 1 << 17  # the longest context a worker that does not state its own is taken to have
TEMPLATE_TOKENS = 16  # what a chat template may add per message (role markers, separators)
PROMPT_SLACK = 256  # ... and once per request (a system preamble, BOS)
NON_TEXT_PART_TOKENS = 4096  # an image or audio part: its tokens are not in the text


@dataclass(frozen=True)
class UsageBounds:
    """The most tokens a request can have used: its prompt (all its prompts, with ``n``) and its
    answer (``max_tokens`` for each choice)."""

    prompt: int
    completion: int


UNBOUNDED = UsageBounds(2**31 - 1, 2**31 - 1)


def checked(prompt: object, completion: object, bounds: UsageBounds) -> tuple[tuple[int, int] | None, str]:
    """((prompt, completion) to use, or None when refused; "" or the reason: ``not_integer``,
    ``negative`` (both refuse the usage) or ``over_bound`` (clamped))."""
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (prompt, completion)):
        return None, "not_integer"
    if prompt < 0 or completion < 0:
        return None, "negative"
    if prompt > bounds.prompt or completion > bounds.completion:
        return (min(prompt, bounds.prompt), min(completion, bounds.completion)), "over_bound"
    return (prompt, completion), ""


def _count(body: dict, name: str, default: int, most: int) -> int:
    v = body.get(name)
    return v if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= most else default


def foreign_bounds(endpoint: str, body: dict, prompt_text: str, max_tokens: int | None,
                   max_model_len: int | None) -> UsageBounds:
    """The bounds of a request sent as it is to an OpenAI-compatible worker: a prompt token is at
    least one byte of the prompt's text (or one id of a prompt given as token ids), plus what a chat
    template adds per message; an answer is at most ``max_tokens`` per choice (else the worker's
    context, ``max_model_len`` when it states one)."""
    items = body.get("messages") if endpoint == "chat" else body.get("prompt")
    items = items if isinstance(items, list) else [items]
    prompts = 1 if endpoint == "chat" or not all(isinstance(p, (str, list)) for p in items) else max(1, len(items))
    non_text = sum(1 for m in items if isinstance(m, dict) and isinstance(m.get("content"), list)
                   for p in m["content"] if isinstance(p, dict) and p.get("type", "text") != "text")
    token_ids = sum(len(p) for p in items if isinstance(p, list)) + (
        len(items) if all(isinstance(p, int) for p in items) else 0)
    prompt = (len(prompt_text.encode("utf-8", "surrogatepass")) + token_ids + TEMPLATE_TOKENS * len(items)
              + PROMPT_SLACK + NON_TEXT_PART_TOKENS * non_text)
    context = max_model_len or UNSTATED_CONTEXT
    prompt = min(prompt, context * prompts)
    choices = prompts * _count(body, "n", 1, 128)
    return UsageBounds(prompt, choices * (context if max_tokens is None else min(max_tokens, context)))
