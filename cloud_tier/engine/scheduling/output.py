"""What ``Scheduler.schedule()`` returns: a plain dataclass the runner executes and the engine
reports from, so the scheduler is tested without torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from cloud_tier.engine.request import Request
from cloud_tier.engine.swap import SwapIn, SwapOut


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # the proposed tokens included
    block_ids: list[int]
    spec_token_ids: tuple[int, ...] = ()  # proposed tokens computed after the known ones, to verify

    @property
    def start(self) -> int:
        """Position of the first token computed this step."""
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a new token is sampled."""
        known = self.num_new_tokens - len(self.spec_token_ids)
        return self.request.num_computed_tokens + known == self.request.num_tokens

    @property
    def num_known_tokens(self) -> int:
        """The tokens computed this step that are the request's own (not proposed)."""
        return self.num_new_tokens - len(self.spec_token_ids)

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.samples


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)  # deadline passed: ended with what they had
    rejected: list[Request] = field(default_factory=list)  # TTFT target passed (or would) while queued: refused
    promised: list[Request] = field(default_factory=list)  # queued with a promised first token when planned
    swap_out: list[SwapOut] = field(default_factory=list)  # KV to copy out before the step ...
    swap_in: list[SwapIn] = field(default_factory=list)  # ... and back in, after the copies out

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_decode)

    @property
    def num_prefill_seqs(self) -> int:
        return sum(1 for s in self.scheduled if not s.is_decode)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def unschedule(self, request: Request) -> int:
        """Take a preempted ``request`` out of this step; the tokens it had from the budget."""
        for i, s in enumerate(self.scheduled):
            if s.request is request:
                del self.scheduled[i]
                return s.num_new_tokens
        return 0
