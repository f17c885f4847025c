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


# -- on the wire (worker -> gateway, one JSON object per line) --------------------------------

def event_to_wire(ev: TokenEvent | Finish) -> dict:
    if isinstance(ev, Finish):
        fields = [ev.finish_reason, ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens, ev.text]
        return {"finish": fields + [ev.truncated] if ev.truncated else fields}
    return {"token": [ev.token_id, ev.text, ev.piece.hex(), ev.logprob, ev.entropy,
                      [[t.token_id, t.text, t.logprob, t.bytes.hex()] for t in ev.top]]}


def event_from_wire(data: dict) -> TokenEvent | Finish:
    """The inverse of ``event_to_wire``; ValueError on anything else."""
    try:
        if "finish" in data:
            reason, prompt, completion, cached, text, *truncated = data["finish"]
            if len(truncated) > 1:
                raise ValueError("too many finish fields")
            return Finish(str(reason), int(prompt), int(completion), int(cached), str(text),
                          str(truncated[0]) if truncated else "")
        tid, text, piece, logprob, entropy, top = data["token"]
        return TokenEvent(int(tid), str(text), bytes.fromhex(piece), float(logprob), float(entropy),
                          tuple(TopToken(int(a), str(b), float(c), bytes.fromhex(d)) for a, b, c, d in top))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a generation event: {str(data)[:200]}") from e
