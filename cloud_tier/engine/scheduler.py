"""The scheduler: which requests run this step, and how many tokens each (continuous batching
with a token budget, chunked prefill, preemption by swap or recompute), ordered and admitted
against service-level objectives.

Order: priority class (interactive, escalation, batch), then the priority number, then slack: a
request is due to start at arrival + its TTFT target - its own prefill time, so the one closest to
missing goes first (without a target, at arrival + ``untargeted_slack_s``: FCFS among themselves).

``schedule()`` composes passes, each a module of ``cloud_tier/engine/scheduling/``: deadlines
(a request whose deadline passes ends with what it has: finish "length", ``truncated =
"deadline"``) and hopeless requests (``admission``: SLO promises that can no longer be kept), the
step's budget (``budget``: token budget, TPOT caps, the short-prompt lane), the running pass
(``running``: decodes, then prefill chunks, preempting for KV room), the waiting pass
(``waiting``: reservations, class yield, the prefix-hit guard, lanes and chunking), then the
swap-ins. It returns a plain dataclass (``output``) and ``update()`` consumes the sampled tokens,
so the scheduler is tested without torch.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable

from cloud_tier.engine.kv_cache_manager import KVCacheManager
from cloud_tier.engine.request import Request, RequestStatus
from cloud_tier.engine.scheduling.admission import SloAdmission
from cloud_tier.engine.scheduling.budget import StepBudget
from cloud_tier.engine.scheduling.output import SchedulerOutput
from cloud_tier.engine.scheduling.pools import TenantPools
from cloud_tier.engine.scheduling.running import schedule_running
from cloud_tier.engine.scheduling.speculation import schedule_speculation
from cloud_tier.engine.scheduling.step_cost import StepCostModel
from cloud_tier.engine.scheduling.tenants import Reservations
from cloud_tier.engine.scheduling.waiting import WaitingPass
from cloud_tier.engine.swap import SwapIn, SwapOut, SwapSpace
from cloud_tier.engine_config import SchedulerConfig

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic,
                 cost: StepCostModel | None = None, swap: SwapSpace | None = None):
        """``swap``: where preempted requests' KV may go (default: none, every preemption recomputes)."""
        self.config = config
        self.kv = kv
        self.clock = clock
        self.cost = cost or StepCostModel()
        self.swap = swap or SwapSpace()
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # prefilled for a decode worker: blocks kept until released
        self.admission = SloAdmission(config, self.cost, self.waiting, self.running, clock)
        self.pools = TenantPools(Reservations.parse(config.reservations), kv, self.running, config.max_num_seqs)
        self.num_preemptions = 0
        self.num_expired = 0

    # -- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue ``request`` (ValueError if it can never run here; SLOMissError if it would miss
        its TTFT target: nothing is queued then)."""
        self._check_new_id(request.request_id)
        self.check_admissible(request)
        self.admission.admit(request)
        self.requests[request.request_id] = request
        self._enqueue(request)

    @property
    def num_rejected(self) -> Counter[str]:
        """By tenant: requests refused for their TTFT target."""
        return self.admission.num_rejected

    def tpot_target(self, request: Request) -> float | None:
        return self.admission.tpot_target(request)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine's measured time of a step it ran (``SloAdmission.observe_step``)."""
        self.admission.observe_step(out, seconds)

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
        now = self.clock()
        self._expire(out, now)
        if self.config.slo_reject:
            self._reject_hopeless(out, now)
        budget = StepBudget.plan(self.config, self.cost, self.admission.tpot, self.admission.tpot_target,
                                 self.running, self.waiting)
        out.promised = [r for r in self.waiting if r.promised is not None]
        schedule_running(self.running, self.pools, budget, out, self._preempt_for)
        if not out.preempted:
            WaitingPass(self.waiting, self.running, self.kv, self.pools, self.admission, budget, out,
                        self._preempt_for).run()
        schedule_speculation(out, self.pools, budget, self.config.max_model_len)
        self._swap_in_pass(out)
        return out

    # -- deadlines and hopeless requests ------------------------------------------------

    def _expire(self, out: SchedulerOutput, now: float) -> None:
        """End the requests whose deadline has passed, with what they have."""
        for req in [r for r in (*self.running, *self.waiting) if r.slo.deadline is not None and now >= r.slo.deadline]:
            if req in self.running:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.truncated = "deadline"
            self._finish(req, RequestStatus.FINISHED_LENGTH)
            self.num_expired += 1
            out.expired.append(req)

    def _reject_hopeless(self, out: SchedulerOutput, now: float) -> None:
        """Refuse the queued requests whose TTFT promise can no longer be kept (``SloAdmission.hopeless``)."""
        for req in [r for r in self.waiting if self.admission.hopeless(r, now)]:
            self.waiting.remove(req)
            self.num_rejected[req.tenant] += 1
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            out.rejected.append(req)

    # -- after the step ------------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               accepted: dict[str, list[int]] | None = None) -> list[Request]:
        """Advance the counters of what ran, append sampled tokens, finish what has to stop.
        ``accepted``: for a request that verified proposed tokens, those accepted (a prefix of
        them), which come before its sampled token; the KV of the rejected ones is dropped."""
        finished = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += s.num_known_tokens
            token = sampled.get(req.request_id)
            if token is None:
                continue
            good = (accepted or {}).get(req.request_id, []) if s.spec_token_ids else []
            status = None
            for i, t in enumerate([*good, token]):
                if i < len(good):  # an accepted proposal: its KV was computed this step
                    req.num_computed_tokens += 1
                req.append_token(t)
                status = self._stop_status(req, t)
                if status is not None:
                    break
            if s.spec_token_ids:
                req.spec.token_ids = []
                self.kv.truncate(req, req.num_tokens)  # the blocks past it hold rejected proposals
            if status is None and req.kv_transfer:
                status = RequestStatus.FINISHED_TRANSFERRED
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
                finished.append(req)
        return finished

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        p = req.sampling_params
        if req.is_stop_token(token) or (req.guide is not None and req.guide.done):  # its grammar ended
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- helpers -------------------------------------------------------------------------

    def _enqueue(self, request: Request) -> None:
        keys = [r.sort_key() for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, request.sort_key()), request)

    def _preempt_for(self, victim: Request, out: SchedulerOutput) -> int:
        """Preempt ``victim`` in this step's plan: requeued, listed as preempted, out of the step;
        the tokens it had from the budget."""
        self._preempt(victim, out)
        out.preempted.append(victim.request_id)
        return out.unschedule(victim)

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

