"""What the scheduler knows about time: a step-cost model learned from the engine's own steps,
and the TTFT a new request can expect. No torch: tested as tables.

A step costs ``base + per_prefill_token * prefill_tokens + per_prefill_seq * prefill_chunks +
per_decode * decodes`` seconds (each prefill chunk runs its own attention in every layer); the
engine reports each step's (prefill tokens, decodes, seconds, chunks) and the coefficients follow
by exponentially weighted least squares, starting from a prior worth a few steps, so the first
estimates are sane and the model tracks a machine that gets busier.
"""

from __future__ import annotations

import math

import numpy as np


class StepCostModel:
    """Seconds per engine step as a linear function of (1, prefill tokens, decode sequences,
    prefill chunks)."""

    def __init__(self, base_s: float = 0.02, per_prefill_token_s: float = 0.0005, per_decode_s: float = 0.002,
                 decay: float = 0.97, prior_weight: float = 4.0, per_prefill_seq_s: float = 0.0):
        self.decay = decay
        prior = np.array([base_s, per_prefill_token_s, per_decode_s, per_prefill_seq_s])
        # the prior as pseudo-observations: four typical steps whose times it predicts exactly
        xs = np.array([[1.0, 0.0, 1.0, 0.0], [1.0, 256.0, 0.0, 1.0], [1.0, 0.0, 32.0, 0.0], [1.0, 128.0, 0.0, 4.0]])
        self._xtx = prior_weight * xs.T @ xs
        self._xty = prior_weight * xs.T @ (xs @ prior)
        self.coef = prior
        self.num_observed = 0

    @property
    def base_s(self) -> float:
        return float(self.coef[0])

    @property
    def per_prefill_token_s(self) -> float:
        return float(self.coef[1])

    @property
    def per_decode_s(self) -> float:
        return float(self.coef[2])

    @property
    def per_prefill_seq_s(self) -> float:
        return float(self.coef[3])

    def observe(self, prefill_tokens: int, decodes: int, seconds: float, prefill_seqs: int | None = None) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        seqs = (1 if prefill_tokens else 0) if prefill_seqs is None else prefill_seqs
        x = np.array([1.0, float(prefill_tokens), float(decodes), float(seqs)])
        self._xtx = self.decay * self._xtx + np.outer(x, x)
        self._xty = self.decay * self._xty + x * seconds
        coef = _nonnegative_solve(self._xtx + 1e-9 * np.eye(4), self._xty)
        if coef is not None:
            self.coef = coef
        self.num_observed += 1

    def step_s(self, prefill_tokens: int, decodes: int, prefill_seqs: int | None = None) -> float:
        seqs = (1 if prefill_tokens else 0) if prefill_seqs is None else prefill_seqs
        return (self.base_s + self.per_prefill_token_s * prefill_tokens + self.per_decode_s * decodes
                + self.per_prefill_seq_s * seqs)

    def decodes_within(self, seconds: float) -> int:
        """The most decodes one step can carry within ``seconds`` (at least 1)."""
        return max(1, int((seconds - self.base_s) / max(self.per_decode_s, 1e-9)))


def _nonnegative_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """argmin |Ax - b| over x >= 0 for the normal equations ``a x = b`` (a cost is never negative:
    noisy steps can fit a negative base): a coefficient the free fit drives below zero is held at
    zero and the others refit, until none is negative."""
    free = np.ones(len(b), dtype=bool)
    while free.any():
        x = np.zeros(len(b))
        try:
            x[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
        except np.linalg.LinAlgError:
            return None
        if np.all(x >= 0):
            return x
        free &= x > 0
    return None


def estimate_ttft(cost: StepCostModel, prefill_tokens_ahead: int, own_prefill_tokens: int, token_budget: int,
                  decodes: int, slot_wait_steps: int = 0, prompts_ahead: int = 0, step_cap_s: float = math.inf,
                  min_chunk: int = 32) -> float:
    """Seconds until a new request's first token: its slot's wait (steps until enough running
    requests finish), then the steps that prefill what is ahead of it and itself, each carrying
    the running decodes. Under a TPOT target (``step_cap_s``: the longest a step may take) a step
    takes only the prefill that fits beside the decodes, at least ``min_chunk`` tokens of one
    prompt (as the scheduler does), so the same prefill takes more, shorter steps."""
    tokens = prefill_tokens_ahead + own_prefill_tokens
    work = cost.per_prefill_token_s * tokens + cost.per_prefill_seq_s * (prompts_ahead + 1)
    per_step = cost.base_s + cost.per_decode_s * decodes
    steps = max(1, math.ceil(_prefill_steps(cost, tokens, work, token_budget, per_step, step_cap_s, min_chunk)))
    return slot_wait_steps * cost.step_s(0, decodes) + steps * per_step + work


def prefill_delay(cost: StepCostModel, tokens: int, token_budget: int, decodes: int, step_cap_s: float = math.inf,
                  min_chunk: int = 32) -> float:
    """Seconds a prompt of ``tokens`` served first adds to the first token of a request queued behind
    it: its prefill work and its share of the steps that carry it (``estimate_ttft``'s terms)."""
    work = cost.per_prefill_token_s * tokens + cost.per_prefill_seq_s
    per_step = cost.base_s + cost.per_decode_s * decodes
    return work + per_step * _prefill_steps(cost, tokens, work, token_budget, per_step, step_cap_s, min_chunk)


def _prefill_steps(cost: StepCostModel, tokens: int, work: float, token_budget: int, per_step: float,
                   step_cap_s: float, min_chunk: int) -> float:
    """Steps (fractional) that prefill ``tokens`` (``work`` seconds of it): the token budget's, or
    under a TPOT target (``step_cap_s``) those whose prefill fits beside the decodes, at least
    ``min_chunk`` tokens of one prompt each, if more."""
    steps = tokens / max(token_budget, 1)
    if step_cap_s < math.inf:
        room = max(step_cap_s - per_step, cost.per_prefill_seq_s + cost.per_prefill_token_s * min_chunk)
        steps = max(steps, work / room)
    return steps
