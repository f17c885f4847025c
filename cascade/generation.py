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
