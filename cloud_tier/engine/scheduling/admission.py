"""SLO admission: the promises the scheduler makes when a request comes, and keeps.

A request with a TTFT target is admitted only if its first token can come within (1 -
``slo_headroom``) of that target (``SLOMissError`` otherwise: the server's 429 + Retry-After,
reason "slo"). The admission is a promise: a later request with less slack goes ahead only of
those whose promise can take its prefill, the steps that run over their estimates move the queued
promises (``observe_step``), and a request whose promise slipped past its limit (or whose target
passed) while it queued is refused before it starts (``hopeless``). A TPOT target bounds how many
run at once (``step_cap``, ``slot_capacity``: ``TpotPolicy``).
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable

from cloud_tier.engine.request import Request, RequestStatus
from cloud_tier.engine.scheduling.budget import is_short
from cloud_tier.engine.scheduling.output import SchedulerOutput
from cloud_tier.engine.scheduling.step_cost import StepCostModel, estimate_ttft, prefill_delay
from cloud_tier.engine.scheduling.tenants import TpotPolicy
from cloud_tier.engine_config import SchedulerConfig


class SLOMissError(ValueError):
    """Refused: this request would miss its TTFT target (a server answers 429 + Retry-After)."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SloAdmission:
    """The service-level side of a scheduler: targets, TTFT estimates and promises over its
    queues (``waiting`` and ``running`` are the scheduler's own lists, read here, never changed)."""

    def __init__(self, config: SchedulerConfig, cost: StepCostModel, waiting: list[Request], running: list[Request],
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.cost = cost
        self.tpot = TpotPolicy(config.tpot_min_batch, config.min_tpot_s, config.max_num_seqs)
        self.waiting = waiting
        self.running = running
        self.clock = clock
        self.num_rejected: Counter[str] = Counter()  # by tenant: refused for their TTFT target

    def admit(self, request: Request) -> None:
        """Set ``request``'s due time and, under a TTFT target, its promised first token, moving the
        promises of those it goes ahead of (SLOMissError: it would miss its target; nothing changed
        but its due time)."""
        ttft = self.ttft_target(request)
        if request.due is None:
            request.due = (request.arrival_time + self.config.untargeted_slack_s if ttft is None else
                           request.arrival_time + ttft - self.cost.step_s(request.num_tokens, 0))
        if ttft is not None and self.config.slo_reject:
            passed, delay = self.place(request)
            request.promised = self.clock() + self.check_ttft(request, ttft)
            for r in passed:
                r.promised += delay

    def hopeless(self, request: Request, now: float) -> bool:
        """Whether queued ``request``, not started, is past its TTFT target or its promised first
        token slipped past what an admission may promise: served it would count for nobody's
        goodput and delay those that still can make it."""
        ttft = self.ttft_target(request)
        if ttft is None or request.num_output_tokens or request.num_preemptions:
            return False
        return not (now <= request.arrival_time + ttft
                    and (request.promised is None or request.promised <= self.promise_by(request)))

    def ttft_target(self, request: Request) -> float | None:
        return request.slo.ttft_s if request.slo.ttft_s is not None else self.config.default_ttft_s

    def tpot_target(self, request: Request) -> float | None:
        """The TPOT target ``request`` is served at: its own or the default, raised to the engine's
        floor (``TpotPolicy.floor``)."""
        asked = request.slo.tpot_s if request.slo.tpot_s is not None else self.config.default_tpot_s
        return self.tpot.effective(asked, self.cost)

    def estimate_ttft(self, request: Request) -> float:
        """Seconds until ``request``'s first token if queued now: the prefill ahead of it (requests
        that would be served before it), its own, and the wait for a running slot when every one
        allowed (by max_num_seqs and the TPOT targets) is taken by requests it does not outrank."""
        key = request.sort_key()
        ahead = [r for r in self.waiting if r.sort_key() <= key]
        # requests of a lower class give their slot and their KV up to it (preemption): not in its way
        running = [r for r in self.running if r.slo.rank <= request.slo.rank]
        tokens_ahead = sum(r.num_tokens - r.num_computed_tokens for r in ahead)
        # running prefills still to finish ahead of it, except the long ones a short prompt runs beside
        tokens_ahead += sum(left - 1 for r in running if (left := r.num_tokens - r.num_computed_tokens) > 1
                            and not (is_short(request, self.config) and not is_short(r, self.config)
                                     and self.config.short_lane_share > 0))
        floor = self.step_cap(request)
        capacity = self.slot_capacity(floor)
        # when a slot frees for it, in decode steps: the running hold theirs for what they may still
        # generate, and each request ahead takes the first one free for all it may generate
        free_at = [max(1, r.sampling_params.max_tokens - r.num_output_tokens) for r in running[:capacity]]
        free_at += [0] * (capacity - len(free_at))
        heapq.heapify(free_at)
        for r in ahead:
            heapq.heapreplace(free_at, free_at[0] + r.sampling_params.max_tokens)
        prompts_ahead = len(ahead) + sum(1 for r in running if r.num_tokens - r.num_computed_tokens > 1)
        # the steps of its prefill carry the running decodes and those ahead of it, prefilled first
        decodes = min(len(running) + len(ahead), capacity)
        return estimate_ttft(self.cost, tokens_ahead, request.num_tokens - request.num_computed_tokens,
                             self.config.max_num_batched_tokens, decodes, free_at[0], prompts_ahead, floor,
                             self.config.min_prefill_chunk)

    def place(self, request: Request) -> tuple[list[Request], float]:
        """Where a targeted newcomer queues: by its slack, but ahead only of those admitted requests
        of its class and priority whose promised first token can take its prefill on top (behind the
        last that cannot: an admission is a promise a later one does not break). Returns the requests
        it goes ahead of and the delay it adds to them."""
        floor = self.step_cap(request)
        decodes = min(len(self.running) + len(self.waiting), self.slot_capacity(floor))
        delay = prefill_delay(self.cost, request.num_tokens - request.num_computed_tokens,
                              self.config.max_num_batched_tokens, decodes, floor, self.config.min_prefill_chunk)
        key = request.sort_key()
        passed = [r for r in self.waiting if r.promised is not None and not r.num_output_tokens
                  and r.sort_key()[:2] == key[:2] and r.sort_key() > key]
        blocking = [r for r in passed if r.promised + delay > self.promise_by(r)]
        if blocking:
            request.due = max(r.due for r in blocking)
            passed = [r for r in passed if r.sort_key() > request.sort_key()]
        return passed, delay

    def step_cap(self, request: Request) -> float:
        """The longest a step may take with ``request`` running, as far as its admission goes: the
        tightest TPOT target of its own and its tenant's running requests (inf: none has one)."""
        return self.tpot.binding_cap(request.tenant, self.tpot_target(request),
                                     ((r.tenant, self.tpot_target(r)) for r in self.running))

    def slot_capacity(self, step_cap_s: float) -> int:
        """Running requests at once under ``step_cap_s`` (``step_cap``; ``TpotPolicy.capacity``)."""
        return self.tpot.capacity(self.cost, step_cap_s)

    def check_ttft(self, request: Request, ttft: float) -> float:
        """Seconds from now to ``request``'s first token, as estimated (SLOMissError: past what an
        admission may promise)."""
        now = self.clock()
        estimate = self.estimate_ttft(request)
        if now + estimate > self.promise_by(request):
            self.num_rejected[request.tenant] += 1
            expected = now + estimate - request.arrival_time
            raise SLOMissError(f"this request would get its first token in about {expected:.1f} s, "
                               f"{'over' if expected > ttft else 'too close to'} its time-to-first-token target "
                               f"of {ttft:g} s", max(1.0, expected - ttft))
        return estimate

    def promise_by(self, request: Request) -> float:
        """The latest first token an admission may promise ``request`` (which has a TTFT target)."""
        return request.arrival_time + (1 - self.config.slo_headroom) * self.ttft_target(request)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine's measured time of a step it ran: the cost model learns from it, and the
        first tokens promised to the queued requests move by what it took over (or under) its
        estimate (the steps of a burst's arrival run slower: the server parses it on the same cores)."""
        slip = seconds - self.cost.step_s(out.num_prefill_tokens, out.num_decodes, out.num_prefill_seqs)
        for r in out.promised:  # those queued when it was planned (a newcomer's estimate starts after it)
            if r.status == RequestStatus.WAITING:
                r.promised += slip
        self.cost.observe(out.num_prefill_tokens, out.num_decodes, seconds, out.num_prefill_seqs)
