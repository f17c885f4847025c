"""What a generation produces, token by token: the shared shape of the edge backends' and the
cloud engine's output, from which both tiers' servers build OpenAI responses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TopToken:
    token_id: int
    text: str
    logprob: float
    bytes: bytes


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: its released text (may be "" while held back), its logprob and
    alternatives, and its entropy (nats) for the cascade's confidence signals."""

    token_id: int
    text: str
    piece: bytes
    logprob: float
    entropy: float
    top: tuple[TopToken, ...] = ()


@dataclass(frozen=True)
class Finish:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens reused from the previous request's KV
    text: str = ""  # trailing text released at the end (held back for a stop check)
    truncated: str = ""  # ended early with what it had, and why ("deadline"); finish_reason is "length"
    draft_offered: int = 0  # a draft's tokens (cascade.draft) the engine verified ...
    draft_accepted: int = 0  # ... and how many of them it kept


# -- on the wire (worker -> gateway, one JSON object per line) --------------------------------

def event_to_wire(ev: TokenEvent | Finish) -> dict:
    if isinstance(ev, Finish):
        fields = [ev.finish_reason, ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens, ev.text]
        wire = {"finish": fields + [ev.truncated] if ev.truncated else fields}
        if ev.draft_offered:
            wire["draft"] = [ev.draft_offered, ev.draft_accepted]
        return wire
    return {"token": [ev.token_id, ev.text, ev.piece.hex(), ev.logprob, ev.entropy,
                      [[t.token_id, t.text, t.logprob, t.bytes.hex()] for t in ev.top]]}


def event_from_wire(data: dict) -> TokenEvent | Finish:
    """The inverse of ``event_to_wire``; ValueError on anything else."""
    try:
        if "finish" in data:
            reason, prompt, completion, cached, text, *truncated = data["finish"]
            if len(truncated) > 1:
                raise ValueError("too many finish fields")
            offered, accepted = _draft_counts(data.get("draft", [0, 0]))
            return Finish(str(reason), int(prompt), int(completion), int(cached), str(text),
                          str(truncated[0]) if truncated else "", offered, accepted)
        tid, text, piece, logprob, entropy, top = data["token"]
        return TokenEvent(int(tid), str(text), bytes.fromhex(piece), float(logprob), float(entropy),
                          tuple(TopToken(int(a), str(b), float(c), bytes.fromhex(d)) for a, b, c, d in top))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a generation event: {str(data)[:200]}") from e


MAX_DRAFT = 64  # cascade.protocol.MAX_DRAFT_TOKENS


def _draft_counts(value) -> tuple[int, int]:
    """A worker's (offered, accepted) draft counts, checked: two integers, 0 <= accepted <= offered
    <= MAX_DRAFT (they reach a Prometheus counter and an answer); ValueError otherwise."""
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            or not 0 <= value[1] <= value[0] <= MAX_DRAFT):
        raise ValueError("draft counts must be [offered, accepted] with 0 <= accepted <= offered <= 64")
    return value[0], value[1]
