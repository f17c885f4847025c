"""A device's draft: K tokens it generated after the prompt (an escalation's hold-back) and,
optionally, the probability it gave each one (``probs``) and its whole processed distribution per
position as sparse (token id, prob) pairs (``top``), which the engine verifies in one pass instead
of generating those tokens again. Plain data, no torch: the gateway builds it from a request's
``cascade.draft`` (``draft_of``), the request record carries it to a worker (``draft_fields``),
the engine verifies it (``cloud_tier.engine.spec``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cascade.protocol import DraftOptions

MAX_DRAFT_TOKENS = 64
# q is known over the whole vocabulary where the listed mass reaches this (a greedy or top-k device
# sends its full support); below it the tail is unknown and no rejection sampling is exact
FULL_SUPPORT = 1 - 1e-6


class DraftError(ValueError):
    """A draft that is not well formed; ``param`` names the field (``cascade.draft.probs``)."""

    def __init__(self, message: str, param: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class Draft:
    token_ids: tuple[int, ...]
    probs: tuple[float, ...] | None = None  # q(x_i) of each drafted token under the device's distribution
    top: tuple[tuple[tuple[int, float], ...], ...] | None = None  # per position: (token id, q) pairs

    @classmethod
    def of(cls, token_ids, probs=None, top=None) -> Draft:
        """A draft from JSON-like lists (tuples made here; nothing checked yet: ``check``)."""
        return cls(tuple(token_ids), None if probs is None else tuple(probs),
                   None if top is None else tuple(tuple((t, p) for t, p in row) for row in top))

    def check(self, vocab_size: int, prefix: str = "cascade.draft") -> None:
        """DraftError naming the first bad field: ids outside [0, vocab_size), more than
        MAX_DRAFT_TOKENS, probabilities not finite in [0, 1], lengths that differ, a drafted
        token its own distribution gives no mass."""
        k = len(self.token_ids)
        if not 1 <= k <= MAX_DRAFT_TOKENS:
            raise DraftError(f"a draft has 1 to {MAX_DRAFT_TOKENS} tokens, got {k}", f"{prefix}.token_ids")
        for i, t in enumerate(self.token_ids):
            if not _is_id(t, vocab_size):
                raise DraftError(f"token id {t!r} is not in [0, {vocab_size})", f"{prefix}.token_ids[{i}]")
        if self.probs is not None:
            if len(self.probs) != k:
                raise DraftError(f"{len(self.probs)} probabilities for {k} tokens", f"{prefix}.probs")
            for i, p in enumerate(self.probs):
                if not _is_prob(p) or p == 0:
                    raise DraftError(f"{p!r} is not a probability in (0, 1]", f"{prefix}.probs[{i}]")
        if self.top is not None:
            if len(self.top) != k:
                raise DraftError(f"{len(self.top)} distributions for {k} tokens", f"{prefix}.top")
            for i, row in enumerate(self.top):
                self._check_row(i, row, vocab_size, f"{prefix}.top[{i}]")

    def _check_row(self, i: int, row, vocab_size: int, param: str) -> None:
        seen = set()
        for t, p in row:
            if not _is_id(t, vocab_size) or t in seen:
                raise DraftError(f"token id {t!r} is not in [0, {vocab_size}) or is listed twice", param)
            if not _is_prob(p):
                raise DraftError(f"{p!r} is not a probability in [0, 1]", param)
            seen.add(t)
        if sum(p for _, p in row) > 1 + 1e-3:
            raise DraftError("the probabilities add up to more than 1", param)
        q = dict(row).get(self.token_ids[i], 0.0)
        if q <= 0:
            raise DraftError(f"the drafted token {self.token_ids[i]} has no probability in it", param)
        if self.probs is not None and abs(q - self.probs[i]) > 1e-3:
            raise DraftError(f"gives the drafted token {q}, probs gives it {self.probs[i]}", param)

    def distributions(self) -> list[dict[int, float]] | None:
        """q at each position over the whole vocabulary (token id -> prob; absent: 0), or None when
        some position's is not known (no full ``top`` there, and no ``probs`` of 1: a greedy device)."""
        out = []
        for i, x in enumerate(self.token_ids):
            row = dict(self.top[i]) if self.top is not None else {}
            if sum(row.values()) >= FULL_SUPPORT:
                out.append(row)
            elif self.probs is not None and self.probs[i] >= FULL_SUPPORT:
                out.append({x: 1.0})
            else:
                return None
        return out


def _is_id(t, vocab_size: int) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size


def _is_prob(p) -> bool:
    return isinstance(p, (int, float)) and not isinstance(p, bool) and math.isfinite(p) and 0 <= p <= 1


def draft_of(options: DraftOptions | None, identity: str, vocab_size: int) -> Draft | None:
    """The draft a request offers, if this server can use it: None without one, or when its
    tokenizer identity is not ``identity`` (this server's; "" takes none: the request runs as if it
    offered none, a draft being an offer, never a requirement). DraftError naming the field when
    the tokenizer is ours but the draft is not one it could have made (ids outside the vocabulary,
    a drafted token its own distribution gives no mass, ...)."""
    if options is None or not identity or options.tokenizer != identity:
        return None
    draft = Draft.of(options.token_ids, options.probs, options.top)
    draft.check(vocab_size)
    return draft


def draft_fields(draft: Draft | None) -> dict:
    """A draft as the request record's fields (``RequestRecord.draft()`` reads them back)."""
    if draft is None:
        return {}
    return {"draft_token_ids": list(draft.token_ids),
            "draft_probs": None if draft.probs is None else list(draft.probs),
            "draft_top": None if draft.top is None else [[list(pair) for pair in pos] for pos in draft.top]}
