"""A draft to verify: the tokens a device already generated after the prompt (an escalation's
hold-back), which the engine checks in one pass instead of generating them again. Plain data, no
torch: the gateway builds it from a request's ``cascade.draft`` (``draft_of``), the request record
carries it to a worker, and the engine verifies it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cascade.protocol import DraftOptions

_FULL_MASS = 1.0 - 1e-6  # a ``top`` that covers this much of the distribution is the distribution


@dataclass(frozen=True)
class Draft:
    token_ids: tuple[int, ...]
    probs: tuple[float, ...] | None = None  # the device's probability of each drafted token
    top: tuple[tuple[tuple[int, float], ...], ...] | None = None  # its distribution, per position

    def __post_init__(self):
        n = len(self.token_ids)
        if not 1 <= n <= 64:
            raise ValueError(f"a draft has 1..64 tokens, not {n}")
        for name in ("probs", "top"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"draft {name} has {len(value)} entries for {n} tokens")
        if self.probs is not None and not all(math.isfinite(p) and 0.0 <= p <= 1.0 for p in self.probs):
            raise ValueError("draft probs must be numbers in [0, 1]")
        for pos in self.top or ():
            if not all(math.isfinite(p) and 0.0 <= p <= 1.0 for _, p in pos):
                raise ValueError("draft top probabilities must be numbers in [0, 1]")

    @property
    def greedy(self) -> bool:
        """Drawn greedily by the device (each token had probability 1 there)."""
        return self.probs is not None and all(p >= _FULL_MASS for p in self.probs)

    def full_support(self) -> bool:
        """``top`` holds the device's whole distribution at every position (exact speculative
        sampling needs it)."""
        return self.top is not None and all(sum(p for _, p in pos) >= _FULL_MASS for pos in self.top)


def draft_of(options: DraftOptions | None, identity: str, vocab_size: int) -> Draft | None:
    """The draft a request offers, if this server can use it: its tokenizer identity must equal
    ``identity`` (this server's; "" accepts none) and its token ids lie in the vocabulary, else
    None (the request runs as if it offered none: a draft is an offer, never a requirement)."""
    if options is None or not identity or options.tokenizer != identity:
        return None
    if any(t >= vocab_size for t in options.token_ids) or any(
            t >= vocab_size for pos in options.top or () for t, _ in pos):
        return None
    return Draft(tuple(options.token_ids), None if options.probs is None else tuple(options.probs),
                 None if options.top is None else tuple(tuple((int(t), float(p)) for t, p in pos)
                                                        for pos in options.top))


def draft_fields(draft: Draft | None) -> dict:
    """A draft as the request record's fields (``RequestRecord.draft()`` reads them back)."""
    if draft is None:
        return {}
    return {"draft_token_ids": list(draft.token_ids),
            "draft_probs": None if draft.probs is None else list(draft.probs),
            "draft_top": None if draft.top is None else [[list(pair) for pair in pos] for pos in draft.top]}
