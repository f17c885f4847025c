"""Low confidence: over the answer's first K tokens (or all of it, if shorter), the mean and the
minimum token logprob and the mean entropy against calibrated thresholds. ``Confidence`` keeps
the K values themselves too (``logprobs``, ``entropies``): the router (``policy.router``) reads
their quantiles, and the agent returns them in ``cascade.confidence`` for calibration."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ConfidenceConfig:
    window: int = 16  # K: tokens judged (and held back while streaming)
    min_mean_logprob: float = -math.inf  # escalate below this mean logprob ...
    min_token_logprob: float = -math.inf  # ... or if any token is below this ...
    max_mean_entropy: float = math.inf  # ... or if the mean entropy (nats) is above this

    @property
    def enabled(self) -> bool:
        return (self.min_mean_logprob > -math.inf or self.min_token_logprob > -math.inf
                or self.max_mean_entropy < math.inf)


@dataclass
class Confidence:
    """Running statistics over the first ``window`` tokens."""

    window: int = 16
    n: int = 0
    sum_logprob: float = 0.0
    min_logprob: float = 0.0
    sum_entropy: float = 0.0
    logprobs: list[float] = field(default_factory=list)  # the first ``window`` tokens' logprobs, in order
    entropies: list[float] = field(default_factory=list)  # ... and their entropies (nats)

    def add(self, logprob: float, entropy: float) -> None:
        if self.n >= self.window:
            return
        self.min_logprob = logprob if self.n == 0 else min(self.min_logprob, logprob)
        self.n += 1
        self.sum_logprob += logprob
        self.sum_entropy += entropy
        self.logprobs.append(logprob)
        self.entropies.append(entropy)

    @property
    def full(self) -> bool:
        return self.n >= self.window

    @property
    def mean_logprob(self) -> float:
        return self.sum_logprob / self.n if self.n else 0.0

    @property
    def mean_entropy(self) -> float:
        return self.sum_entropy / self.n if self.n else 0.0

    def as_dict(self) -> dict:
        return {"tokens": self.n, "mean_logprob": round(self.mean_logprob, 4),
                "min_logprob": round(self.min_logprob, 4), "mean_entropy": round(self.mean_entropy, 4),
                "logprobs": [round(x, 4) for x in self.logprobs], "entropies": [round(x, 4) for x in self.entropies]}


def low_confidence(c: Confidence, config: ConfidenceConfig) -> bool:
    if c.n == 0:
        return False
    return (c.mean_logprob < config.min_mean_logprob or c.min_logprob < config.min_token_logprob
            or c.mean_entropy > config.max_mean_entropy)
