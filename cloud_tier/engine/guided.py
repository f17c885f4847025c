"""Guided decoding: a request whose ``SamplingParams.guided`` names an llguidance grammar gets a
``Matcher`` (``cascade.structured.matcher``) on its record (``Request.guide``); each step its row's
logits keep only the tokens the grammar allows next, and the sampled token advances it.

``Guides`` is the engine's: one ``GrammarCache`` for its tokenizer, built on the first guided request
(about a second for a 150k vocabulary). ``mask_rows`` and ``advance_rows`` are the sampler's two
passes: one packed bitmask [guided rows, ceil(V/32)] filled by the matchers, unpacked and applied to
those rows alone (the other rows are the model's logits untouched), then each sampled token accepted.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from cascade.structured.matcher import GrammarCache, Matcher

log = logging.getLogger(__name__)


@dataclass
class GuidedCounts:
    requests: int = 0  # guided requests added or adopted
    refused: int = 0  # grammars that could not be compiled


class Guides:
    """The compiled grammars of one engine's tokenizer (thread-safe: requests are made on any thread)."""

    def __init__(self, tokenizer, n_vocab: int, eos_token_ids: frozenset[int]):
        """``n_vocab``: the logits' width (the model's vocabulary, padding rows included: never allowed);
        ``eos_token_ids``: those the engine stops on, which the grammar allows only where it may end."""
        self.tokenizer, self.n_vocab, self.eos_token_ids = tokenizer, n_vocab, sorted(eos_token_ids)
        self.counts = GuidedCounts()
        self._cache: GrammarCache | None = None
        self._lock = threading.Lock()

    @property
    def cache(self) -> GrammarCache:
        """The grammar cache, built on first use (ValueError if llguidance cannot read this tokenizer)."""
        with self._lock:
            if self._cache is None:
                from llguidance.hf import from_tokenizer

                try:
                    lltok = from_tokenizer(self.tokenizer, n_vocab=self.n_vocab, eos_token=self.eos_token_ids)
                except Exception as e:  # a slow (Python) tokenizer, an unreadable one: no guided decoding here
                    raise ValueError(f"guided decoding is unavailable with this model's tokenizer: {e}") from e
                self._cache = GrammarCache(lltok, self.n_vocab)
            return self._cache

    def warm(self) -> None:
        """Build the cache now (a worker does at start, off its event loop, so that its first guided
        request does not wait for it); a tokenizer llguidance cannot read is logged, not raised."""
        try:
            cache = self.cache
        except ValueError as e:
            log.warning("%s", e)
            return
        log.debug("guided decoding ready: %d tokens", cache.n_vocab)

    @property
    def compiles(self) -> int:
        return 0 if self._cache is None else self._cache.compiles

    def matcher(self, grammar: str, output_token_ids: list[int] = ()) -> Matcher:
        """A matcher for ``grammar`` that has consumed ``output_token_ids`` (a request adopted with its
        first token). ``GrammarRefused`` (a ValueError) if the grammar cannot be compiled; ValueError if
        those tokens do not follow it."""
        try:
            m = self.cache.matcher(grammar)
        except ValueError:
            self.counts.refused += 1
            raise
        for t in output_token_ids:
            if not m.accept(t):
                raise ValueError(f"its output so far does not follow its grammar at token {t}: {m.error}")
        return m

    def count(self, request) -> None:
        """Count ``request`` if guided (on the engine's thread, as it is added or adopted)."""
        self.counts.requests += request.guide is not None


@dataclass
class GuidedRows:
    """The guided rows of one sampled batch and the rows whose matcher failed (row -> why)."""

    rows: list[int]
    errors: dict[int, str] = field(default_factory=dict)


def mask_rows(logits: torch.Tensor, requests: list) -> tuple[torch.Tensor, GuidedRows]:
    """``logits`` [B, V] with the rows of guided requests masked (a copy; the same tensor if none is
    guided): -inf wherever the grammar does not allow the token next. A row whose matcher failed is
    left unmasked and listed in the errors."""
    guided = GuidedRows([i for i, r in enumerate(requests) if r.guide is not None])
    if not guided.rows:
        return logits, guided
    vocab = logits.shape[-1]
    bits = np.zeros((len(guided.rows), -(-vocab // 32)), dtype=np.int32)
    for k, i in enumerate(guided.rows):
        guide: Matcher = requests[i].guide
        try:
            if not guide.failed:
                guide.bitmask_into(bits[k])
        except Exception as e:  # a matcher's bug fails its request, not the batch
            guided.errors[i] = f"its grammar could not give the next tokens: {e!r}"
        if guide.failed:
            guided.errors[i] = f"its grammar failed: {guide.error}"
        if i in guided.errors or not bits[k].any():
            bits[k] = -1  # placeholder: the row is reported, and the batch is sampled as usual
            guided.errors.setdefault(i, "its grammar allows no next token")
    # the inverted bits unpacked are the blocked tokens, one byte each (0 or 1): a bool array as it is
    blocked = np.unpackbits((~bits).view(np.uint8), axis=1, count=vocab, bitorder="little").view(np.bool_)
    blocked = torch.from_numpy(blocked).to(logits.device)
    if len(guided.rows) == len(requests):
        return logits.masked_fill(blocked, float("-inf")), guided
    idx = torch.tensor(guided.rows, device=logits.device)
    masked = logits.clone()
    masked[idx] = logits[idx].masked_fill(blocked, float("-inf"))
    return masked, guided


def advance_rows(token_ids: list[int], requests: list, guided: GuidedRows, errors: dict[int, str]) -> None:
    """Each guided row's sampled token into its matcher; the rows that fail (a token outside the
    grammar: should not happen) into ``errors``, which already holds the rows not sampled."""
    errors.update(guided.errors)
    for i in guided.rows:
        if i in errors:
            continue
        guide: Matcher = requests[i].guide
        try:
            if not guide.accept(token_ids[i]):
                errors[i] = f"its grammar refused the sampled token {token_ids[i]}: {guide.error}"
        except Exception as e:  # a matcher's bug fails its request, not the batch
            errors[i] = f"its grammar could not take the sampled token {token_ids[i]}: {e!r}"
