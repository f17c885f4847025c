"""Prompt-lookup proposals (vLLM's ``ngram`` method, no draft model): the last n tokens of a
request (n from ``ngram_max`` down to ``ngram_min``) matched against its own earlier tokens
(prompt and output); the tokens that followed the latest match are proposed."""

from __future__ import annotations


def propose_ngram(tokens: list[int], k: int, ngram_min: int = 1, ngram_max: int = 3) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` (``ngram_max`` down to ``ngram_min`` long) that occurs earlier; [] if none does."""
    n_tokens = len(tokens)
    for n in range(min(ngram_max, n_tokens - 1), ngram_min - 1, -1):
        suffix = tokens[n_tokens - n:]
        first = suffix[0]
        # latest start first; a match must end before the suffix starts so something follows it
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start] == first and tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []
