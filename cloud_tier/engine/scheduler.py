"""The scheduler: which requests run this step, and how many tokens each (continuous batching
with a token budget, chunked prefill, FCFS with priorities, preemption by recompute).

``schedule()`` returns a plain dataclass and ``update()`` consumes the sampled tokens, so the
scheduler is tested without torch. Each policy is a separate pass: running requests first
(decodes and unfinished prefill chunks), then waiting ones with what is left of the budget.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from cloud_tier.engine.kv_cache_manager import KVCacheBlocks, KVCacheManager
from cloud_tier.engine.request import Request, RequestStatus
from cloud_tier.engine.swap import SwapIn, SwapOut, SwapSpace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128  # requests in one batch
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # cap on one request's prefill chunk; 0: the budget

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError("max_num_seqs, max_num_batched_tokens >= 1 and max_model_len >= 2")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill the token budget must cover max_model_len")


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[int]

    @property
    def start(self) -> int:
        """Position of the first token computed this step."""
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a new token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    swap_out: list[SwapOut] = field(default_factory=list)  # KV to copy out before the step ...
    swap_in: list[SwapIn] = field(default_factory=list)  # ... and back in, after the copies out

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # prefilled for a decode worker: blocks kept until released
        self.num_preemptions = 0
        self.swap = SwapSpace()  # the engine gives it a mode, a budget and its costs

    # -- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._check_new_id(request.request_id)
        self.check_admissible(request)
        self.requests[request.request_id] = request
        self._enqueue(request)

    def peak_kv_tokens(self, request: Request) -> int:
        """The most tokens of KV ``request`` can hold at once: everything but its last token,
        which is sampled and never computed (a prefill for a transfer stops at its prompt)."""
        if request.kv_transfer:
            return request.num_prompt_tokens
        last = min(request.num_prompt_tokens + request.sampling_params.max_tokens, self.config.max_model_len)
        return max(last - 1, request.num_tokens)

    def check_admissible(self, request: Request) -> None:
        """ValueError for a request that could never run here, even alone: admitted, it would
        preempt itself forever and block the queue behind it."""
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(f"prompt of {request.num_tokens} tokens does not fit max_model_len "
                             f"{self.config.max_model_len}")
        peak = self.peak_kv_tokens(request)
        capacity = self.kv.num_blocks * self.kv.block_size
        if self.kv.blocks_for_tokens(peak) > self.kv.num_blocks:
            raise ValueError(f"request {request.request_id!r} can need {peak} tokens of KV (prompt "
                             f"{request.num_prompt_tokens} + max_tokens {request.sampling_params.max_tokens}) "
                             f"but the whole KV cache holds {capacity} tokens: lower max_tokens or the prompt")

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.requests or request_id in self.held:
            raise ValueError(f"duplicate request id {request_id!r}: a request with this id is in flight")

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside (abort, a stop string matched) and free their blocks."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self._finish(req, status)
            done.append(req)
        return done

    def adopt(self, request: Request) -> bool:
        """Take over a request prefilled elsewhere: its prompt's KV is about to be written into
        the blocks allocated here, so it runs from ``num_computed_tokens == prompt length`` with
        its first token already sampled. False (nothing changed) if the blocks do not fit."""
        self._check_new_id(request.request_id)
        if request.num_computed_tokens or request.num_output_tokens != 1:
            raise ValueError("an adopted request has its first token and nothing computed yet")
        self.check_admissible(request)
        if self.kv.allocate_slots(request, request.num_prompt_tokens) is None:
            return False
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)
        return True

    def release(self, request_id: str) -> None:
        """Free the blocks of a request held for a KV transfer (no-op if not held)."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.kv.free(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        self._swap_in_pass(out)
        return out

    def _chunk(self, request: Request, budget: int, num_hit: int = 0) -> int:
        """Tokens to compute for ``request`` this step (a whole prompt, a chunk of it, or 1)."""
        n = request.num_tokens - request.num_computed_tokens - num_hit
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        return min(n, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        for req in sorted(self.running, key=Request.sort_key):
            if budget <= 0:
                break
            if req not in self.running:  # preempted earlier in this pass
                continue
            n = self._chunk(req, budget)
            while self.kv.allocate_slots(req, n) is None:
                victim = max(self.running, key=Request.sort_key)
                self._preempt(victim, out)
                out.preempted.append(victim.request_id)
                budget += self._unschedule(out, victim)  # on a (priority, arrival) tie it may have run
                if victim is req:
                    n = 0
                    break
            if n:
                out.scheduled.append(ScheduledRequest(req, n, self.kv.get_block_ids(req.request_id)))
                budget -= n
        return budget

    @staticmethod
    def _unschedule(out: SchedulerOutput, request: Request) -> int:
        """Take a preempted ``request`` out of this step; the tokens it had from the budget."""
        for i, s in enumerate(out.scheduled):
            if s.request is request:
                del out.scheduled[i]
                return s.num_new_tokens
        return 0

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            computed: KVCacheBlocks | None = None
            num_hit = 0
            if req.num_computed_tokens == 0:
                computed, num_hit = self.kv.get_computed_blocks(req)
            n = req.num_tokens - req.num_computed_tokens - num_hit
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = self._chunk(req, budget, num_hit)
            if self.kv.allocate_slots(req, n, computed) is None:
                break  # no room: it stays first in line (FCFS), nothing behind it jumps ahead
            if req.num_cached_tokens < 0:  # first admitted (not a resumption after preemption)
                req.num_cached_tokens = num_hit
                self.kv.stats.record(req.num_tokens, num_hit)
            self.waiting.pop(0)
            req.num_computed_tokens += num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, self.kv.get_block_ids(req.request_id)))
            budget -= n

    # -- after the step ------------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the counters of what ran, append sampled tokens, finish what has to stop."""
        finished = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += s.num_new_tokens
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.append_token(token)
            status = self._stop_status(req, token)
            if status is None and req.kv_transfer:
                status = RequestStatus.FINISHED_TRANSFERRED
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
                finished.append(req)
        return finished

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        p = req.sampling_params
        if req.is_stop_token(token):
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- helpers -------------------------------------------------------------------------

    def _enqueue(self, request: Request) -> None:
        keys = [r.sort_key() for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, request.sort_key()), request)

    def _preempt(self, request: Request, out: SchedulerOutput | None = None) -> None:
        """Give a running request's memory back and requeue it (its arrival time keeps it at the
        front), by swap or by recompute, whichever ``self.swap`` finds cheaper for it: a swap
        keeps its computed tokens and lists its blocks in ``out`` to be copied out before the step
        reuses them; a recompute drops them."""
        rid = request.request_id
        blocks = self.kv.get_block_ids(rid)[:self.kv.blocks_for_tokens(request.num_computed_tokens)]
        swap = out is not None and self.swap.choose(rid, len(blocks), request.num_computed_tokens) == "swap"
        self.running.remove(request)
        self.kv.free_preempted(request)
        if swap:
            out.swap_out.append(SwapOut(rid, tuple(blocks)))
        else:
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)
        log.debug("preempted %s", request.request_id)

    def _swap_in_pass(self, out: SchedulerOutput) -> None:
        """List the swapped-out requests that run again this step: their new blocks get their KV
        back before the forward (after the step's copies out, which may include its own)."""
        for s in out.scheduled:
            rid = s.request.request_id
            if self.swap.is_swapped(rid):
                out.swap_in.append(SwapIn(rid, tuple(s.block_ids[:self.swap.num_blocks(rid)])))

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.swap.drop(request.request_id)  # it may end while swapped out (aborted)
        if status == RequestStatus.FINISHED_TRANSFERRED:
            self.held[request.request_id] = request
        elif status == RequestStatus.FINISHED_ERROR:  # its KV may never have been written
            self.kv.discard(request)
        else:
            self.kv.free(request)
        self.requests.pop(request.request_id, None)

