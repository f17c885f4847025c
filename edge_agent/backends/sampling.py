"""Sampling one sequence's next token from a logits row with numpy, for backends that hand us
logits (ONNX Runtime GenAI) rather than sampling themselves (llama.cpp).

The semantics are the cloud engine's (cloud_tier/engine/sampler.py), so a request samples alike
on either tier: penalties on the raw logits (repetition over prompt and output, presence and
frequency over the output), then temperature, then top-k, top-p and min-p masks over the
tempered distribution (the most likely token always survives). Each request draws from its own
numpy Generator, seeded from ``GenerationOptions.seed`` so a seed reproduces a completion.

Everything here runs once per generated token over the whole vocabulary (49k for SmolLM2), while
a decode step of a small model takes a few ms: so no full sorts, partitions or cumsums over the
vocabulary where a cheaper pass finds the same answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from edge_agent.backends.base import GenerationOptions


class LogitsSampler:
    """One request's sampler: ``sample(logits)`` picks a token, ``accept(token)`` records it."""

    def __init__(self, options: GenerationOptions, prompt: Sequence[int], n_vocab: int):
        self.options = options
        self.rng = np.random.default_rng(options.seed)
        o = options
        self._penalize = o.repetition_penalty != 1.0 or o.presence_penalty != 0.0 or o.frequency_penalty != 0.0
        if self._penalize:
            self._seen = np.zeros(n_vocab, dtype=bool)  # prompt and output: repetition penalty
            self._seen[np.asarray(prompt, dtype=np.int64)] = True
            self._counts = np.zeros(n_vocab, dtype=np.float32)  # output only: presence, frequency

    def accept(self, token: int) -> None:
        if self._penalize:
            self._seen[token] = True
            self._counts[token] += 1

    def sample(self, logits: np.ndarray) -> int:
        """The next token for a float32 logits row (not modified)."""
        if self._penalize:
            logits = self._penalized(logits)
        if self.options.temperature == 0.0:
            return int(np.argmax(logits))
        return self._draw(logits / np.float32(self.options.temperature))

    def _penalized(self, logits: np.ndarray) -> np.ndarray:
        o = self.options
        out = logits.copy()
        if o.repetition_penalty != 1.0:
            seen = np.flatnonzero(self._seen)
            vals = out[seen]
            out[seen] = np.where(vals > 0, vals / o.repetition_penalty, vals * o.repetition_penalty)
        if o.presence_penalty or o.frequency_penalty:
            used = np.flatnonzero(self._counts)
            out[used] -= o.presence_penalty + o.frequency_penalty * self._counts[used]
        return out

    def _draw(self, z: np.ndarray) -> int:
        o = self.options
        n = z.shape[0]
        ids = None  # candidate token ids; None: the whole vocabulary
        if 0 < o.top_k < n:
            ids = np.argpartition(z, n - o.top_k)[n - o.top_k:]
        vals = z if ids is None else z[ids]
        top = float(vals.max())
        weights = np.exp(vals - top)  # unnormalised probabilities
        keep = None  # positions into vals
        if o.top_p < 1.0:
            keep = _top_p(vals, weights, top, o.top_p)
        if o.min_p > 0.0:
            # p >= min_p * p_max  <=>  z >= z_max + log(min_p): no normalisation needed
            floor = top + math.log(o.min_p)
            keep = np.flatnonzero(vals >= floor) if keep is None else keep[vals[keep] >= floor]
        if keep is not None:
            ids = keep if ids is None else ids[keep]
            weights = weights[keep]
        pick = _inverse_cdf(weights, self.rng.random())
        return int(pick if ids is None else ids[pick])


def _top_p(vals: np.ndarray, weights: np.ndarray, top: float, p: float) -> np.ndarray:
    """Positions of the smallest most-likely set whose mass before each member is <= p. The
    tokens within a few nats of the best are sorted first: when the cut falls among them, every
    token outside is cut too, and the vocabulary need not be sorted."""
    total = float(weights.sum())
    for margin in (4.0, 8.0, 16.0, math.inf):
        part = np.flatnonzero(vals >= top - margin) if margin != math.inf else np.arange(len(vals))
        part = part[np.argsort(-vals[part], kind="stable")]
        probs = weights[part] / total
        before = np.cumsum(probs) - probs  # mass of strictly more likely tokens
        if before[-1] > p or margin == math.inf:
            return part[before <= p]
    raise AssertionError("unreachable")


_BLOCK = 1024


def _inverse_cdf(weights: np.ndarray, u: float) -> int:
    """The index whose cumulative weight first exceeds ``u`` (in [0, 1)) of the total. Over a
    whole vocabulary, block sums (one matrix product) find the block first: a cumsum over 49k
    floats alone costs ~200 us."""
    n = len(weights)
    if n <= 4 * _BLOCK:
        cum = np.cumsum(weights, dtype=np.float64)
        return min(int(np.searchsorted(cum, u * cum[-1], side="right")), n - 1)
    rows = n // _BLOCK
    sums = weights[:rows * _BLOCK].reshape(rows, _BLOCK) @ np.ones(_BLOCK, dtype=weights.dtype)
    cum = np.cumsum(np.append(sums, weights[rows * _BLOCK:].sum()), dtype=np.float64)
    target = u * cum[-1]
    block = min(int(np.searchsorted(cum, target, side="right")), len(cum) - 1)
    start = block * _BLOCK
    inner = np.cumsum(weights[start:start + _BLOCK], dtype=np.float64)
    rest = target - (cum[block - 1] if block else 0.0)
    return start + min(int(np.searchsorted(inner, rest, side="right")), len(inner) - 1)


class StepStats:
    """The model's own distribution at a step (before penalties and temperature): the chosen
    token's logprob, the entropy in nats, and the top alternatives. Per step this is one exp
    over the vocabulary into a reused buffer, sums as BLAS dot products, and no full logprob
    vector or vocabulary-wide partition (measured on SmolLM2's 49k: ~100 us, most of it exp)."""

    def __init__(self, n_vocab: int):
        self._shifted = np.empty(n_vocab, dtype=np.float32)  # logits - max
        self._exp = np.empty(n_vocab, dtype=np.float32)
        self._ones = np.ones(n_vocab, dtype=np.float32)
        self._log_total = 0.0

    def __call__(self, logits: np.ndarray, masked: bool = False) -> tuple[float, float]:
        """(log of the normaliser, entropy) for ``logits``; logprob(t) = logits[t] - log_z.
        ``masked``: some logits are -inf (a grammar's mask), which add nothing to the entropy."""
        top = logits.max()
        np.subtract(logits, top, out=self._shifted)
        if masked:
            np.maximum(self._shifted, np.float32(-1e30), out=self._shifted)
        np.exp(self._shifted, out=self._exp)
        total = float(np.dot(self._exp, self._ones))
        self._log_total = math.log(total)
        # H = -sum p log p = log(total) - sum(e * shifted) / total, with e = exp(shifted)
        entropy = self._log_total - float(np.dot(self._exp, self._shifted)) / total
        return float(top) + self._log_total, max(entropy, 0.0)

    def top(self, k: int) -> list[tuple[int, float]]:
        """The ``k`` most likely tokens of the last call's logits and their logprobs, most
        likely first. Candidates within a few nats of the best are far fewer than the
        vocabulary; a vocabulary-wide partition only when fewer than ``k`` are."""
        shifted = self._shifted
        for margin in (4.0, 8.0, 16.0):
            idx = np.flatnonzero(shifted >= -margin)
            if len(idx) >= k:
                break
        else:
            idx = np.sort(np.argpartition(shifted, -k)[-k:])
        if len(idx) > 4 * k:
            idx = np.sort(idx[np.argpartition(shifted[idx], len(idx) - k)[len(idx) - k:]])
        idx = idx[np.argsort(-shifted[idx], kind="stable")[:k]]  # ties: the lower id first, as argmax
        return [(t, float(shifted[t]) - self._log_total) for t in idx.tolist()]
