"""Pre-route: is a request too hard for the device, judged before generating anything? A
prompt longer than the local context or a configured limit, or a learned difficulty score from
cheap features (a small logistic model fitted by ``cascade calibrate``) above a threshold."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_CODE = re.compile(r"```|\bdef |\bclass |\bfunction\b|[{};]\s*$|\bimport |#include|SELECT |=>", re.M)
_MATH = re.compile(r"\d+\s*[-+*/^=]\s*\d+|\b(integral|derivative|equation|solve|prove|probability)\b", re.I)
_REASON = re.compile(r"\b(why|explain|compare|analy[sz]e|design|evaluate|derive|step by step)\b", re.I)
_LIST = re.compile(r"\b(list|steps|essay|story|poem|write|summari[sz]e|translate)\b", re.I)
_WORD = re.compile(r"\w+")

FEATURES = ("log_chars", "words_per_sentence", "non_ascii", "code", "math", "reasoning", "long_form",
            "questions", "digits")


def features(text: str) -> dict[str, float]:
    """Cheap features of a prompt's text (length, language, code/math markers, question type)."""
    n = max(len(text), 1)
    words = _WORD.findall(text)
    sentences = max(1, len(re.findall(r"[.!?](\s|$)", text)))
    return {
        "log_chars": math.log1p(len(text)),
        "words_per_sentence": min(len(words) / sentences, 60.0) / 60.0,
        "non_ascii": sum(1 for c in text if ord(c) > 127) / n,
        "code": float(bool(_CODE.search(text))),
        "math": float(bool(_MATH.search(text))),
        "reasoning": float(bool(_REASON.search(text))),
        "long_form": float(bool(_LIST.search(text))),
        "questions": min(text.count("?"), 5) / 5.0,
        "digits": sum(c.isdigit() for c in text) / n,
    }


@dataclass(frozen=True)
class DifficultyModel:
    """A logistic model over ``features``: P(the edge answer is not good enough)."""

    weights: dict[str, float] = field(default_factory=dict)
    bias: float = 0.0

    def score(self, feats: dict[str, float]) -> float:
        z = self.bias + sum(w * feats.get(k, 0.0) for k, w in self.weights.items())
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, z))))

    def to_json(self) -> dict:
        return {"weights": dict(self.weights), "bias": self.bias}

    @classmethod
    def from_json(cls, data: dict) -> DifficultyModel:
        return cls({str(k): float(v) for k, v in data.get("weights", {}).items()}, float(data.get("bias", 0.0)))


def fit(rows: list[dict[str, float]], labels: list[int], epochs: int = 400, lr: float = 0.5,
        l2: float = 1e-3) -> DifficultyModel:
    """Logistic regression by batch gradient descent (a few hundred rows: no library needed)."""
    w = {k: 0.0 for k in FEATURES}
    b = 0.0
    n = max(len(rows), 1)
    for _ in range(epochs):
        gw = {k: 0.0 for k in FEATURES}
        gb = 0.0
        for x, y in zip(rows, labels, strict=True):
            p = DifficultyModel(w, b).score(x)
            for k in FEATURES:
                gw[k] += (p - y) * x.get(k, 0.0)
            gb += p - y
        for k in FEATURES:
            w[k] -= lr * (gw[k] / n + l2 * w[k])
        b -= lr * gb / n
    return DifficultyModel(w, b)


@dataclass(frozen=True)
class HardConfig:
    max_prompt_tokens: int = 0  # 0: only the local context limits
    threshold: float = 1.01  # difficulty score above which a request is hard (> 1: never)
    model: DifficultyModel = field(default_factory=DifficultyModel)


def too_long(prompt_tokens: int, max_tokens: int, n_ctx: int, config: HardConfig) -> bool:
    if prompt_tokens + max_tokens > n_ctx:
        return True
    return bool(config.max_prompt_tokens) and prompt_tokens > config.max_prompt_tokens


def is_hard(score: float, config: HardConfig) -> bool:
    return score > config.threshold
