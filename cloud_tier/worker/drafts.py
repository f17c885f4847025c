"""A device's draft in a request body: ``{"cascade": {"draft": {"token_ids": [...], "probs": [...] |
null, "top": [[[id, p], ...], ...] | null, "tokenizer": "<identity>"}}}``, taken out of the body
before the OpenAI schema reads it, checked (a 400 naming ``cascade.draft...``), and used only when
``tokenizer`` is this worker's tokenizer identity (``tokenizer_identity``); otherwise the request
runs without it and its answer reports no draft."""

from __future__ import annotations

from dataclasses import dataclass

from cascade import errors
from cloud_tier.engine.draft import MAX_DRAFT_TOKENS, Draft, DraftError

PARAM = "cascade.draft"
_FIELDS = {"token_ids", "probs", "top", "tokenizer"}


@dataclass(frozen=True)
class DraftOffer:
    draft: Draft
    tokenizer: str


def pop_draft(body: dict) -> object | None:
    """Take ``cascade.draft`` out of a parsed JSON body (the schema has no field for it); its raw value."""
    options = body.get("cascade")
    if not isinstance(options, dict) or "draft" not in options:
        return None
    raw = options.pop("draft")
    if not options:
        body["cascade"] = None
    return raw


def parse_draft(raw: object, vocab_size: int) -> DraftOffer | None:
    """The draft offered in ``raw`` (None: none), checked against this model's vocabulary; a 400
    naming the field otherwise."""
    if raw is None:
        return None
    try:
        return _parse(raw, vocab_size)
    except DraftError as e:
        raise errors.bad_request(f"Invalid draft: {e}", e.param, "invalid_draft") from e


def _parse(raw: object, vocab_size: int) -> DraftOffer:
    if not isinstance(raw, dict):
        raise DraftError("must be an object", PARAM)
    if unknown := set(raw) - _FIELDS:
        raise DraftError(f"unknown field {sorted(unknown)[0]!r}", f"{PARAM}.{sorted(unknown)[0]}")
    tokenizer = raw.get("tokenizer")
    if not isinstance(tokenizer, str) or not tokenizer:
        raise DraftError("the drafting model's tokenizer identity (a string) is required", f"{PARAM}.tokenizer")
    ids = raw.get("token_ids")
    if not isinstance(ids, list):
        raise DraftError("must be a list of token ids", f"{PARAM}.token_ids")
    if len(ids) > MAX_DRAFT_TOKENS:  # before anything walks it
        raise DraftError(f"a draft has at most {MAX_DRAFT_TOKENS} tokens, got {len(ids)}", f"{PARAM}.token_ids")
    probs, top = raw.get("probs"), raw.get("top")
    if probs is not None and not isinstance(probs, list):
        raise DraftError("must be a list of probabilities or null", f"{PARAM}.probs")
    if top is not None:
        top = [_row(row, i) for i, row in enumerate(top)] if isinstance(top, list) else None
        if top is None:
            raise DraftError("must be a list (one per token) of [token id, probability] lists, or null",
                             f"{PARAM}.top")
    draft = Draft.of(ids, probs, top)
    draft.check(vocab_size, PARAM)
    return DraftOffer(draft, tokenizer)


def _row(row: object, i: int) -> list[tuple[object, object]]:
    if not isinstance(row, list) or len(row) > 4096 or not all(isinstance(p, list) and len(p) == 2 for p in row):
        raise DraftError("must be a list of [token id, probability] pairs", f"{PARAM}.top[{i}]")
    return [(p[0], p[1]) for p in row]
