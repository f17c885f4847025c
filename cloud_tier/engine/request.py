"""The one mutable record per request, owned by one component at a time (nano-vllm Sequence).

Progress is a counter: ``num_computed_tokens`` catches up to ``num_tokens``. A prefill node
advances it to the prompt length; a decode node adopts the request from there.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cascade.protocol import PRIORITY_CLASSES
from cloud_tier.engine.draft import SpecState
from cloud_tier.sampling import SamplingParams

if TYPE_CHECKING:
    from cascade.structured.matcher import Matcher


@dataclass(frozen=True)
class ServiceLevel:
    """What a request is owed: its class, its latency targets and its deadline. None: no target."""

    priority_class: str = "interactive"
    ttft_s: float | None = None  # first token within this long of arrival
    tpot_s: float | None = None  # then one token per this long
    deadline: float | None = None  # time.monotonic() by which it ends, with what it has (finish "length")
    tenant: str = ""  # whose reservation it draws on

    def __post_init__(self):
        if self.priority_class not in PRIORITY_CLASSES:
            raise ValueError(f"priority class must be one of {', '.join(PRIORITY_CLASSES)}, "
                             f"got {self.priority_class!r}")
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")

    @property
    def rank(self) -> int:
        return PRIORITY_CLASSES.index(self.priority_class)


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS, a stop token or a stop string
    FINISHED_LENGTH = 4  # max_tokens or the model's context
    FINISHED_ABORTED = 5
    FINISHED_TRANSFERRED = 6  # prefill done, first token sampled, KV kept for a decode worker
    FINISHED_ERROR = 7  # this request could not go on (its step failed, or its logits); the engine goes on

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort", 6: "transfer", 7: "error"}.get(int(self))


@dataclass(eq=False)  # a mutable record: equal only to itself
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower is served first
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache (-1: not looked up)
    num_preemptions: int = 0
    kv_transfer: bool = False  # prefill only: stop after the first token and keep the KV to send
    slo: ServiceLevel = ServiceLevel()
    truncated: str = ""  # why it ended early with what it had ("deadline"), else ""
    token_ids: list[int] = field(init=False)  # prompt + output, appended as tokens are sampled
    block_hashes: list = field(default_factory=list)  # chained hashes of full blocks, filled lazily
    # when it should start to meet its TTFT target (arrival + target - its own prefill time), set by
    # the scheduler when queued; the last tie-break of its order (slack first, within class and priority)
    due: float | None = None
    # when its first token is expected (the scheduler's clock), as admitted against its TTFT target;
    # a newcomer of its class served before it adds its own prefill time (see SloAdmission.place)
    promised: float | None = None
    spec: SpecState = field(default_factory=SpecState)  # speculation: a draft to verify, proposals (engine/spec)
    # guided decoding: its grammar's matcher, at its output so far (engine/guided); kept across preemptions
    guide: Matcher | None = None

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def is_stop_token(self, token_id: int) -> bool:
        """EOS (unless ignored) or one of ``stop_token_ids``."""
        p = self.sampling_params
        return token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_token_ids)

    @property
    def tenant(self) -> str:
        return self.slo.tenant

    def sort_key(self) -> tuple[int, int, float]:
        """Served first: the higher class, then the lower priority number, then the least slack."""
        return (self.slo.rank, self.priority, self.arrival_time if self.due is None else self.due)
