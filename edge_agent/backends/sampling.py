"""Sampling one sequence's next token from a logits row with numpy, for backends that hand us
logits (ONNX Runtime GenAI) rather than sampling themselves (llama.cpp).

The semantics are the cloud engine's (cloud_tier/engine/sampler.py), so a request samples alike
on either tier: penalties on the raw logits (repetition over prompt and output, presence and
frequency over the output), then temperature, then top-k, top-p and min-p masks over the
tempered distribution (the most likely token always survives). Each request draws from its own
numpy Generator, seeded from ``GenerationOptions.seed`` so a seed reproduces a completion.

Everything here runs once per generated token over the whole vocabulary (49k for SmolLM2), so
it avoids full sorts and reuses its buffers: a decode step of a small model is a few ms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from edge_agent.backends.base import GenerationOptions

_TOP_P_CANDIDATES = 512  # top-p sorts this many tokens first; all of them only if these fall short


class Sampler:
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
        keep = None  # positions into vals
        if o.top_p < 1.0:
            keep = _top_p(vals, top, o.top_p)
        if o.min_p > 0.0:
            # p >= min_p * p_max  <=>  z >= z_max + log(min_p): no normalisation needed
            floor = top + math.log(o.min_p)
            keep = np.flatnonzero(vals >= floor) if keep is None else keep[vals[keep] >= floor]
        if keep is not None:
            ids = keep if ids is None else ids[keep]
            vals = vals[keep]
        weights = np.exp(vals - top)
        cum = np.cumsum(weights)
        pick = min(int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right")), len(cum) - 1)
        return int(pick if ids is None else ids[pick])


def _top_p(vals: np.ndarray, top: float, p: float) -> np.ndarray:
    """Positions of the smallest most-likely set whose mass before each member is <= p."""
    weights = np.exp(vals - top)
    total = weights.sum()
    n = min(len(vals), _TOP_P_CANDIDATES)
    while True:
        part = np.argpartition(-vals, n - 1)[:n] if n < len(vals) else np.arange(len(vals))
        part = part[np.argsort(-vals[part], kind="stable")]
        probs = weights[part] / total
        before = np.cumsum(probs) - probs  # mass of strictly more likely tokens
        if n == len(vals) or before[-1] > p:  # the cut lies within these candidates
            return part[before <= p]
        n = len(vals)


class StepStats:
    """The model's own distribution at a step (before penalties and temperature): the chosen
    token's logprob, the entropy in nats, and the top alternatives, with two vocabulary-sized
    buffers reused across steps (the full logprob vector is never built)."""

    def __init__(self, n_vocab: int):
        self._shifted = np.empty(n_vocab, dtype=np.float32)
        self._exp = np.empty(n_vocab, dtype=np.float32)

    def __call__(self, logits: np.ndarray) -> tuple[float, float]:
        """(log of the normaliser, entropy) for ``logits``; logprob(t) = logits[t] - log_z."""
        top = logits.max()
        np.subtract(logits, top, out=self._shifted)
        np.exp(self._shifted, out=self._exp)
        total = float(self._exp.sum(dtype=np.float64))
        log_total = math.log(total)
        # H = -sum p log p = log(total) - sum(e * shifted) / total, with e = exp(shifted)
        entropy = log_total - float(np.dot(self._exp, self._shifted)) / total
        return float(top) + log_total, max(entropy, 0.0)


def top_logprobs(logits: np.ndarray, log_z: float, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens and their logprobs, most likely first."""
    idx = np.argpartition(logits, -k)[-k:]
    idx = idx[np.argsort(-logits[idx], kind="stable")]
    return [(t, float(logits[t]) - log_z) for t in idx.tolist()]
