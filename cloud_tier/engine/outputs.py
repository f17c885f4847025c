"""What the engine hands back for each request, step by step and at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from cloud_tier.engine.sampler import TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated so far
    text: str = ""  # released so far (stop strings cut)
    new_token_ids: list[int] = field(default_factory=list)  # this step's
    delta_text: str = ""  # this step's
    logprobs: list[TokenLogprobs] | None = None
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "transfer" | "error"
    error: str | None = None  # why, when finish_reason is "error"
    # refused before its first token: it would miss its TTFT target (seconds to wait before a retry)
    retry_after_s: float | None = None
    truncated: str = ""  # ended early with what it had: "deadline"
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    # a device's draft: its tokens received, how many were accepted, and why it was run without
    # ("" if verified): kv_layout, logprobs, penalties, unverifiable, kv_transfer, no_room
    draft_offered: int = 0
    draft_accepted: int = 0
    draft_skipped: str = ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
