"""The engine's side of speculation: a device's draft attached to its request (validated, or
refused with a reason: the request then runs without it), the engine's own n-gram proposals before
each step, and the counts the worker exports."""

from __future__ import annotations

from dataclasses import dataclass

from cloud_tier.engine.draft import Draft
from cloud_tier.engine.request import Request
from cloud_tier.engine.scheduling.output import SchedulerOutput
from cloud_tier.engine.scheduling.speculation import spec_room
from cloud_tier.engine.spec.ngram import propose_ngram


@dataclass
class SpecCounts:
    drafts: int = 0  # drafts received
    drafts_refused: int = 0  # of them, run without (the reason is on the request's output)
    draft_tokens_offered: int = 0
    draft_tokens_accepted: int = 0
    ngram_steps: int = 0  # request-steps that verified an n-gram proposal
    ngram_tokens_proposed: int = 0
    ngram_tokens_accepted: int = 0


class Speculation:
    def __init__(self, method: str, num_tokens: int, ngram_min: int, ngram_max: int, vocab_size: int,
                 max_model_len: int, supported: bool = True):
        """``method``: "" (no proposals of its own) or "ngram"; ``supported``: whether this engine's
        KV layout can drop rejected positions (not with a separate sliding-window group)."""
        self.method, self.num_tokens = method, num_tokens
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.supported = supported
        self.counts = SpecCounts()

    def attach(self, request: Request, draft: Draft) -> None:
        """``draft`` onto ``request``, to verify in its first sampling step (DraftError if malformed;
        one that cannot be verified exactly here is refused: the request runs without it)."""
        draft.check(self.vocab_size)  # on the caller's thread: nothing of the engine's is touched here
        spec = request.spec
        spec.draft, spec.offered, spec.token_ids = draft, len(draft.token_ids), list(draft.token_ids)
        why = self._unsupported(request)
        if why is None and not request.sampling_params.greedy and draft.distributions() is None:
            why = "unverifiable"  # q unknown: no exact rejection sampling
        if why is not None:
            spec.refuse(why)

    def _unsupported(self, request: Request) -> str | None:
        p = request.sampling_params
        if not self.supported:
            return "kv_layout"
        if p.logprobs is not None:
            return "logprobs"
        if p.needs_penalties:
            return "penalties"
        if p.guided is not None:  # a proposal is not checked against the grammar: it runs without
            return "guided"
        return None

    def propose(self, running: list[Request]) -> None:
        """The n-gram proposals of the running requests about to decode (none pending)."""
        if self.method != "ngram":
            return
        for req in running:
            if req.spec.token_ids or req.num_computed_tokens != req.num_tokens - 1 or self._unsupported(req):
                continue
            k = min(self.num_tokens, spec_room(req, self.max_model_len))
            if k > 0:
                req.spec.token_ids = propose_ngram(req.token_ids, k, self.ngram_min, self.ngram_max)

    def added(self, request: Request) -> None:
        """Count the draft of a request the engine took (on the engine's thread)."""
        if request.spec.offered:
            self.counts.drafts += 1
            self.counts.draft_tokens_offered += request.spec.offered

    def finished(self, request: Request) -> None:
        """Count a finished request's refused draft (refused when attached or by the scheduler)."""
        if request.spec.skipped:
            self.counts.drafts_refused += 1

    def observe(self, scheduled: SchedulerOutput, accepted: dict[str, list[int]], failed: dict[str, str]) -> None:
        """Count what the step verified (before ``Scheduler.update`` clears the proposals)."""
        c = self.counts
        for s in scheduled.scheduled:
            rid, spec = s.request.request_id, s.request.spec
            if not s.spec_token_ids or rid in failed:
                continue
            m = len(accepted.get(rid, ()))
            if spec.draft is not None:  # the device's draft, verified now
                spec.accepted = m
                spec.draft = None
                c.draft_tokens_accepted += m
            else:
                spec.proposed += len(s.spec_token_ids)
                spec.proposed_accepted += m
                c.ngram_steps += 1
                c.ngram_tokens_proposed += len(s.spec_token_ids)
                c.ngram_tokens_accepted += m
