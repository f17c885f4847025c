"""An escalation's draft, on the agent's side: the held-back tokens offered to a cloud with the same
tokenizer (``draft_of``: the body's ``cascade.draft``), what a cloud's model list says of its
tokenizers (``tokenizers_of``), and what the cloud says it did with the draft (``draft_counts``,
clamped: the cloud's numbers reach the answer and the agent's metrics)."""

from __future__ import annotations

from cascade.generation import TokenEvent

MAX_DRAFT = 64  # cascade.protocol.MAX_DRAFT_TOKENS


def draft_of(events: list, identity: str, greedy: bool) -> dict | None:
    """The ``cascade.draft`` of a held-back local answer (its first K tokens), for a cloud with the
    same tokenizer to verify instead of generating them again: None without tokens, without this
    model's tokenizer identity, or for a sampled answer (exact verification of a sample needs the
    device's whole distribution at each position, which the agent does not keep)."""
    ids = [e.token_id for e in events if isinstance(e, TokenEvent)][:MAX_DRAFT]
    if not ids or not identity or not greedy:
        return None
    return {"token_ids": ids, "probs": [1.0] * len(ids), "tokenizer": identity}


def tokenizers_of(listing: dict | None) -> dict[str, str]:
    """Each listed model's tokenizer identity (its card's ``meta.tokenizer``, a short token), from
    an OpenAI model list that may hold anything."""
    out: dict[str, str] = {}
    data = listing.get("data") if isinstance(listing, dict) else None
    for card in data if isinstance(data, list) else ():
        meta = card.get("meta") if isinstance(card, dict) else None
        tok = meta.get("tokenizer") if isinstance(meta, dict) else None
        if isinstance(card.get("id"), str) and isinstance(tok, str) and 0 < len(tok) <= 128:
            out[card["id"]] = tok
    return out


def draft_counts(value) -> tuple[int, int] | None:
    """What the cloud says of our draft (``cascade.draft``: offered, accepted), clamped into
    0 <= accepted <= offered <= 64; None when it says nothing usable."""
    if not isinstance(value, dict):
        return None
    offered, accepted = value.get("offered"), value.get("accepted")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offered, accepted)):
        return None
    offered = min(max(offered, 0), MAX_DRAFT)
    return offered, min(max(accepted, 0), offered)
