"""The router: escalate when the cloud's answer is likely better than the device's, P(gap > 0 |
what the device knows), in two stages (RouteLLM, Hybrid LLM predict the same gap).

1. before generating, a *prompt-only* logistic model over cheap prompt features; above
   ``stage1_threshold`` the request goes up at once (reason "hard");
2. else the agent generates the hold-back K tokens, and the *full* model (prompt features plus
   quantiles of those tokens' logprobs and entropies) decides; above ``stage2_threshold`` it goes
   up (reason "low_confidence").

Both models are fitted by ``cascade calibrate`` (cascade/eval/router_fit.py) and kept as JSON
(``Router.to_json``), with the edge model they were calibrated for: an agent serving another
model does not use them. ``Router.from_json`` validates strictly (known feature names, finite
numbers, bounded sizes) and raises ``RouterError`` naming the key. Pure: no I/O here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from cascade.policy.hard import FEATURES as DIFFICULTY_FEATURES
from cascade.policy.hard import features as difficulty_features

FORMAT = "cascade.router/1"
MIN_SCALE = 1e-6  # a feature's standardizing scale: below it one term can overflow to infinity
FEATURE_BOUND = 1e6  # a router file's numbers (means, scales, weights) lie within this
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_OPERATOR = re.compile(r"(?<=[\d\s)])[-+*/%](?=[\s\d(])")
PROMPT_FEATURES = (*DIFFICULTY_FEATURES, "numbers", "longest_number", "operators", "lines", "brackets")
UNCERTAINTY_FEATURES = ("lp_min", "lp_p10", "lp_p25", "lp_median", "lp_mean", "lp_first", "unsure_share", "ent_mean",
                        "ent_max", "finished")
UNSURE_LOGPROB = math.log(0.5)  # a token the model gave less than even odds
# what the tokens' uncertainty means depends on what was asked (the first K tokens of code are
# mostly boilerplate, of a number the answer itself): products of the general prompt categories
# with the main uncertainty features (never a feature per task kind of our generator)
INTERACTIONS = tuple(f"{p}*{u}" for p in ("code", "math", "digits", "numbers", "longest_number")
                     for u in ("lp_min", "lp_mean", "ent_max", "unsure_share", "finished"))
FEATURES = (*PROMPT_FEATURES, *UNCERTAINTY_FEATURES, *INTERACTIONS)
MAX_WINDOW = 4096


class RouterError(ValueError):
    """A router a device cannot use; the message names the key."""


def prompt_features(text: str) -> dict[str, float]:
    """The nine difficulty features plus general ones: how many numbers and how long the longest
    (arithmetic's difficulty grows with digits), operators, lines, brackets (structured input)."""
    feats = difficulty_features(text)
    numbers = _NUMBER.findall(text)
    feats.update(numbers=min(len(numbers), 20) / 20.0,
                 longest_number=min(max((len(n) for n in numbers), default=0), 12) / 12.0,
                 operators=min(len(_OPERATOR.findall(text)), 10) / 10.0,
                 lines=min(text.count("\n") + 1, 50) / 50.0,
                 brackets=min(sum(text.count(c) for c in "{}[]()"), 40) / 40.0)
    return feats


def _quantile(sorted_xs: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def uncertainty_features(logprobs: list[float], entropies: list[float], window: int,
                         finished: bool = False) -> dict[str, float]:
    """Quantiles of the first K tokens' logprobs, the first token's, the share of tokens below
    even odds, their mean and max entropy, and whether the answer ended within them (all 0 for no
    tokens)."""
    if not logprobs:
        return {k: 0.0 for k in UNCERTAINTY_FEATURES} | {"finished": float(finished)}
    lp = sorted(logprobs)
    return {"lp_min": lp[0], "lp_p10": _quantile(lp, 0.10), "lp_p25": _quantile(lp, 0.25),
            "lp_median": _quantile(lp, 0.5), "lp_mean": sum(lp) / len(lp), "lp_first": logprobs[0],
            "unsure_share": sum(x < UNSURE_LOGPROB for x in lp) / len(lp),
            "ent_mean": sum(entropies) / len(entropies) if entropies else 0.0,
            "ent_max": max(entropies) if entropies else 0.0,
            "finished": float(finished or len(logprobs) < window)}


def combined(prompt: dict[str, float], uncertainty: dict[str, float]) -> dict[str, float]:
    """Stage 2's features: the prompt's, the tokens', and their ``INTERACTIONS``."""
    feats = prompt | uncertainty
    for name in INTERACTIONS:
        p, u = name.split("*")
        feats[name] = feats.get(p, 0.0) * feats.get(u, 0.0)
    return feats


@dataclass(frozen=True)
class Stage:
    """A logistic model over standardized features: sigmoid(bias + sum w * (x - mean) / scale)."""

    weights: dict[str, float]
    mean: dict[str, float]
    scale: dict[str, float]
    bias: float = 0.0

    def score(self, feats: dict[str, float]) -> float:
        z = self.bias + sum(w * (feats.get(k, 0.0) - self.mean[k]) / self.scale[k] for k, w in self.weights.items())
        if math.isnan(z):  # infinite features pulling both ways: no opinion
            z = 0.0
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, z))))

    def to_json(self) -> dict:
        return {"weights": dict(self.weights), "mean": dict(self.mean), "scale": dict(self.scale), "bias": self.bias}


@dataclass(frozen=True)
class Router:
    edge_model: str  # the served model's name it was calibrated for
    edge_sha256: str  # its GGUF's digest ("" if the agent could not tell it)
    window: int  # K: the hold-back tokens stage 2 reads
    stage1: Stage  # prompt features only
    stage2: Stage  # prompt and uncertainty features
    stage1_threshold: float  # escalate before generating above this (> 1: never)
    stage2_threshold: float  # escalate after the hold-back above this (> 1: never)
    target_escalation: float = 0.0  # what the thresholds were chosen for (informational)

    def before(self, prompt: dict[str, float]) -> bool:
        """Stage 1: sure enough before generating that the cloud answers better."""
        return self.stage1.score(prompt) > self.stage1_threshold

    def after(self, prompt: dict[str, float], uncertainty: dict[str, float]) -> bool:
        """Stage 2: after the hold-back, with what the first K tokens say."""
        return self.stage2.score(combined(prompt, uncertainty)) > self.stage2_threshold

    def matches(self, model: str, sha256: str = "") -> bool:
        """Calibrated for this model: the same name, and the same digest when both are known."""
        return model == self.edge_model and (not sha256 or not self.edge_sha256 or sha256 == self.edge_sha256)

    def to_json(self) -> dict:
        return {"format": FORMAT, "edge_model": self.edge_model, "edge_sha256": self.edge_sha256,
                "window": self.window, "stage1": self.stage1.to_json(), "stage2": self.stage2.to_json(),
                "stage1_threshold": self.stage1_threshold, "stage2_threshold": self.stage2_threshold,
                "target_escalation": self.target_escalation}

    @classmethod
    def from_json(cls, data) -> Router:
        """Strictly: RouterError naming the first key that is missing, of the wrong type, not a
        finite number, or a feature the agent does not compute."""
        if not isinstance(data, dict):
            raise RouterError("router: a router is a JSON object")
        keys = ("format", "edge_model", "edge_sha256", "window", "stage1", "stage2", "stage1_threshold",
                "stage2_threshold")
        for key in keys:
            if key not in data:
                raise RouterError(f"router: missing key {key!r}")
        unknown = set(data) - {*keys, "target_escalation"}
        if unknown:
            raise RouterError(f"router: unknown key {sorted(unknown)[0][:64]!r}")
        if data["format"] != FORMAT:
            raise RouterError(f"router: 'format' must be {FORMAT!r}")
        for key in ("edge_model", "edge_sha256"):
            if not isinstance(data[key], str) or len(data[key]) > 256:
                raise RouterError(f"router: {key!r} must be a string of at most 256 characters")
        if not data["edge_model"]:
            raise RouterError("router: 'edge_model' must name the model it was calibrated for")
        window = data["window"]
        if not isinstance(window, int) or isinstance(window, bool) or not 1 <= window <= MAX_WINDOW:
            raise RouterError(f"router: 'window' must be an integer in 1..{MAX_WINDOW}")
        return cls(data["edge_model"], data["edge_sha256"], window,
                   _stage(data["stage1"], "stage1", PROMPT_FEATURES), _stage(data["stage2"], "stage2", FEATURES),
                   _number(data["stage1_threshold"], "stage1_threshold", 0.0, 2.0),
                   _number(data["stage2_threshold"], "stage2_threshold", 0.0, 2.0),
                   _number(data.get("target_escalation", 0.0), "target_escalation", 0.0, 1.0))


def _number(value, key: str, low: float = -FEATURE_BOUND, high: float = FEATURE_BOUND) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
            or not low <= value <= high:
        raise RouterError(f"router: {key!r} must be a finite number in {low:g}..{high:g}")
    return float(value)


def _stage(value, key: str, allowed: tuple[str, ...]) -> Stage:
    if not isinstance(value, dict) or set(value) != {"weights", "mean", "scale", "bias"}:
        raise RouterError(f"router: {key!r} must be {{\"weights\", \"mean\", \"scale\", \"bias\"}}")
    maps = {}
    for part in ("weights", "mean", "scale"):
        m = value[part]
        if not isinstance(m, dict) or len(m) > len(allowed):
            raise RouterError(f"router: '{key}.{part}' must map at most {len(allowed)} features to numbers")
        for name, w in m.items():
            if name not in allowed:
                raise RouterError(f"router: '{key}.{part}' names {str(name)[:64]!r}, not a feature of this stage "
                                  f"(one of {', '.join(allowed)})")
            _number(w, f"{key}.{part}.{name}")
        maps[part] = {k: float(v) for k, v in m.items()}
    if set(maps["mean"]) != set(maps["weights"]) or set(maps["scale"]) != set(maps["weights"]):
        raise RouterError(f"router: '{key}' mean and scale must name the same features as its weights")
    for name, s in maps["scale"].items():
        if not MIN_SCALE <= s:  # a tinier scale overflows a term to infinity: the score would be NaN
            raise RouterError(f"router: '{key}.scale.{name}' must be at least {MIN_SCALE}")
    return Stage(maps["weights"], maps["mean"], maps["scale"], _number(value["bias"], f"{key}.bias"))
