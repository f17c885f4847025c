"""Per-request sampling and stopping parameters: what the gateway asks of a worker (in the
request record) and what the engine samples with. Plain data, no torch."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

# As vLLM: a smaller temperature or repetition penalty would overflow the logits to inf/NaN.
MIN_TEMPERATURE = 0.01
MIN_REPETITION_PENALTY = 0.01
MAX_GUIDED_BYTES = 256 * 1024  # a grammar (llguidance's) longer than this is refused


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (vLLM's field names and meanings)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy; (0, 0.01) samples as 0.01
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's and top-k
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in prompt or output; at least 0.01
    presence_penalty: float = 0.0  # OpenAI: on tokens present in the output
    frequency_penalty: float = 0.0  # OpenAI: by count in the output
    include_stop_str_in_output: bool = False
    guided: str | None = None  # an llguidance grammar the output tokens must follow (cascade.structured)
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if self.guided is not None and (not isinstance(self.guided, str) or not self.guided
                                        or len(self.guided.encode()) > MAX_GUIDED_BYTES):
            raise ValueError(f"guided must be a non-empty grammar of at most {MAX_GUIDED_BYTES} bytes")
        if 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        object.__setattr__(self, "repetition_penalty", max(self.repetition_penalty, MIN_REPETITION_PENALTY))
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def to_dict(self) -> dict:
        """The JSON form carried in a ``RequestRecord`` (``from_dict`` reads it back)."""
        d = dataclasses.asdict(self)
        d.pop("extra", None)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """ValueError/TypeError on fields that are unknown or out of range."""
        return cls(**d)
