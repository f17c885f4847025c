"""What the scheduler knows about time: a step-cost model learned from the engine's own steps,
the TTFT a new request can expect, and the tenants' reservations. No torch: tested as tables.

A step costs ``base + per_prefill_token * prefill_tokens + per_prefill_seq * prefill_chunks +
per_decode * decodes`` seconds (each prefill chunk runs its own attention in every layer); the
engine reports each step's (prefill tokens, decodes, seconds, chunks) and the coefficients follow
by exponentially weighted least squares, starting from a prior worth a few steps, so the first
estimates are sane and the model tracks a machine that gets busier.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from cloud_tier.config import parse_reservations


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


@dataclass(frozen=True)
class Reservations:
    """Per-tenant shares of the KV blocks and of the running slots that another tenant's flood
    cannot take: ``"gold=0.3,silver=0.1"``. A tenant with a share uses it first, then the shared
    rest like anyone; tenants with none (or no tenant named) share what is not reserved. An unused
    share is kept free for its tenant, so a burst of theirs starts at once, not after a preemption."""

    shares: dict[str, float]

    @classmethod
    def parse(cls, text: str) -> Reservations:
        return cls(parse_reservations(text))

    def __bool__(self) -> bool:
        return bool(self.shares)

    def group(self, tenant: str) -> str:
        """The pool a tenant draws on: its own reservation, or the shared rest ("")."""
        return tenant if tenant in self.shares else ""

    def amount(self, tenant: str, total: int) -> int:
        return int(self.shares.get(tenant, 0.0) * total)

    def held_back(self, tenant: str, total: int, used: dict[str, int]) -> int:
        """How much of ``total`` the *other* tenants' unused reservations keep from ``tenant``."""
        return sum(max(0, int(share * total) - used.get(name, 0))
                   for name, share in self.shares.items() if name != tenant)


@dataclass(frozen=True)
class TpotPolicy:
    """What a TPOT target may ask of an engine that serves everyone (issue 37 item 3).

    - A target is served no tighter than ``floor``: the longer of ``min_tpot_s`` and a step of
      ``min_batch`` decodes (as measured); a tighter one is served best-effort at the floor.
    - A target bounds the running batch only for its own tenant's newcomers (and a newcomer's
      own target bounds itself), never below ``min_batch``: one tenant's targets do not cut the
      batch another tenant's requests run in.
    """

    min_batch: int
    min_tpot_s: float
    max_num_seqs: int

    def floor(self, cost: StepCostModel) -> float:
        return max(self.min_tpot_s, cost.step_s(0, min(self.min_batch, self.max_num_seqs)))

    def effective(self, target: float | None, cost: StepCostModel) -> float | None:
        """``target`` as served: raised to the floor (None: no target)."""
        return None if target is None else max(target, self.floor(cost))

    def capacity(self, cost: StepCostModel, step_cap_s: float) -> int:
        """Running requests at once under a step of at most ``step_cap_s``: max_num_seqs, fewer
        when one step of them all would take longer, never fewer than ``min_batch``."""
        if step_cap_s == math.inf:
            return self.max_num_seqs
        return min(self.max_num_seqs, max(self.min_batch, cost.decodes_within(step_cap_s)))

    @staticmethod
    def binding_cap(tenant: str, own_target: float | None, running: Iterable[tuple[str, float | None]]) -> float:
        """The longest a step may take with a newcomer of ``tenant`` running: the tightest of its
        own (effective) target and those of its own tenant's running requests (inf: none)."""
        caps = [t for name, t in running if t is not None and name == tenant]
        if own_target is not None:
            caps.append(own_target)
        return min(caps, default=math.inf)
