"""The scheduler: which requests run this step, and how many tokens each (continuous batching
with a token budget, chunked prefill, preemption by recompute), ordered and admitted against
service-level objectives.

Order: priority class (interactive, escalation, batch), then the priority number, then slack: a
request is due to start at arrival + its TTFT target - its own prefill time, so the one closest to
missing goes first (without a target, at arrival + ``untargeted_slack_s``: FCFS among themselves).

Admission keeps the running decodes within their TPOT target: a step's prefill tokens are capped
at what the learned step cost (``slo.StepCostModel``) allows next to the decodes, and a request
joins the running set only while one step of all of them fits the tightest target of its own
tenant's (``slo.TpotPolicy``: a target is served no tighter than a step of ``tpot_min_batch``
decodes, and one tenant's targets never cut the batch another's requests run in). Long prompts
take at most ``1 - short_lane_share`` of a step's prefill tokens while a short prompt waits, so a
short request is never stuck behind a long prefill. A request that would miss its TTFT target
anyway is refused when it comes (``SLOMissError``: the server's 429 + Retry-After, reason "slo").
An admission is a promise of a first token within (1 - ``slo_headroom``) of the target: a later
request with less slack goes ahead only of those whose promise can take its prefill, the steps
that run over their estimates move the queued promises, and a request whose promise slipped past
its limit (or whose target passed) while it queued is refused before it starts. Tenants'
reservations (``slo.Reservations``) keep a share of blocks and slots free for each.

Deadlines: a request whose deadline passes ends with what it has (finish "length",
``truncated = "deadline"``).

``schedule()`` returns a plain dataclass and ``update()`` consumes the sampled tokens, so the
scheduler is tested without torch. Each policy is a separate pass: deadlines and hopeless requests
first, then running requests (decodes and unfinished prefill chunks), then waiting ones with what
is left of the budget.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cloud_tier.engine.kv_cache_manager import KVCacheBlocks, KVCacheManager
from cloud_tier.engine.request import Request, RequestStatus
from cloud_tier.engine.slo import Reservations, StepCostModel, TpotPolicy, estimate_ttft, prefill_delay
from cloud_tier.engine.swap import SwapIn, SwapOut, SwapSpace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128  # requests in one batch
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # cap on one request's prefill chunk; 0: the budget
    # service levels: targets for requests that name none (None: no target), and what to do about them
    default_ttft_s: float | None = None
    default_tpot_s: float | None = None
    slo_reject: bool = True  # refuse what would miss its TTFT target (only requests that have one)
    untargeted_slack_s: float = 60.0  # a request without a TTFT target is due this long after arrival
    # an admission promises the first token within (1 - this) of the TTFT target: the rest is for the
    # answer's way to the client (the server's own work on the same cores) and the estimate's error
    slo_headroom: float = 0.25
    short_prompt_tokens: int = 256  # a prompt (left to compute) this short is in the short lane ...
    short_lane_share: float = 0.25  # ... which keeps this share of a step's prefill tokens while one waits
    min_prefill_chunk: int = 32  # the least prefill a step takes under a TPOT cap, so prompts progress
    reservations: str = ""  # "tenant=share,...": KV blocks and running slots kept for each tenant
    # what a TPOT target may ask (slo.TpotPolicy): never a batch under this many, nor a step shorter than
    # theirs or than min_tpot_s; a tighter target is served best-effort at that floor
    tpot_min_batch: int = 8
    min_tpot_s: float = 0.0

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError("max_num_seqs, max_num_batched_tokens >= 1 and max_model_len >= 2")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill the token budget must cover max_model_len")
        for name in ("default_ttft_s", "default_tpot_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 (or None: no target), got {v!r}")
        if not 0 <= self.short_lane_share < 1 or self.min_prefill_chunk < 1 or self.short_prompt_tokens < 1:
            raise ValueError("short_lane_share must be in [0, 1), min_prefill_chunk and short_prompt_tokens >= 1")
        if not 0 <= self.slo_headroom < 1:
            raise ValueError(f"slo_headroom must be in [0, 1), got {self.slo_headroom!r}")
        Reservations.parse(self.reservations)
        if self.tpot_min_batch < 1 or not 0 <= self.min_tpot_s < math.inf:
            raise ValueError(f"tpot_min_batch must be >= 1 and min_tpot_s a number >= 0, got "
                             f"{self.tpot_min_batch!r}, {self.min_tpot_s!r}")


class SLOMissError(ValueError):
    """Refused: this request would miss its TTFT target (a server answers 429 + Retry-After)."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


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
    expired: list[Request] = field(default_factory=list)  # deadline passed: ended with what they had
    rejected: list[Request] = field(default_factory=list)  # TTFT target passed (or would) while queued: refused
    promised: list[Request] = field(default_factory=list)  # queued with a promised first token when planned

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not _is_decode(s))

    @property
    def num_prefill_seqs(self) -> int:
        return sum(1 for s in self.scheduled if not _is_decode(s))

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if _is_decode(s))
    swap_out: list[SwapOut] = field(default_factory=list)  # KV to copy out before the step ...
    swap_in: list[SwapIn] = field(default_factory=list)  # ... and back in, after the copies out

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _tpot_key(request: Request) -> str:
    """The blocked-pool key of a tenant held out by its own TPOT targets (never a reservation group's)."""
    return f"\0tpot:{request.tenant}"


def _is_decode(s: ScheduledRequest) -> bool:
    return s.num_new_tokens == 1 and s.samples


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic,
                 cost: StepCostModel | None = None):
        self.config = config
        self.kv = kv
        self.clock = clock
        self.cost = cost or StepCostModel()
        self.reservations = Reservations.parse(config.reservations)
        self.tpot = TpotPolicy(config.tpot_min_batch, config.min_tpot_s, config.max_num_seqs)
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # prefilled for a decode worker: blocks kept until released
        self.num_preemptions = 0
        self.num_rejected: Counter[str] = Counter()  # by tenant: refused for their TTFT target
        self.num_expired = 0
        # this step's allowances (_plan_prefill): prefill tokens, the long lane's part, the tightest TPOT
        self._token_room = self._long_room = config.max_num_batched_tokens
        self._caps: dict[str, float] = {}  # by tenant: the tightest TPOT target of its running requests
        self._decodes, self._prefill_s = 0, 0.0
        self.swap = SwapSpace()  # the engine gives it a mode, a budget and its costs

    # -- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue ``request`` (ValueError if it can never run here; SLOMissError if it would miss
        its TTFT target: nothing is queued then)."""
        self._check_new_id(request.request_id)
        self.check_admissible(request)
        ttft = self.ttft_target(request)
        if request.due is None:
            request.due = (request.arrival_time + self.config.untargeted_slack_s if ttft is None else
                           request.arrival_time + ttft - self.cost.step_s(request.num_tokens, 0))
        if ttft is not None and self.config.slo_reject:
            passed, delay = self._place(request)
            request.promised = self.clock() + self._check_ttft(request, ttft)
            for r in passed:
                r.promised += delay
        self.requests[request.request_id] = request
        self._enqueue(request)

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
                            and not (self._is_short(request) and not self._is_short(r)
                                     and self.config.short_lane_share > 0))
        floor = self._step_cap(request)
        capacity = self._slot_capacity(floor)
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

    def _place(self, request: Request) -> tuple[list[Request], float]:
        """Where a targeted newcomer queues: by its slack, but ahead only of those admitted requests
        of its class and priority whose promised first token can take its prefill on top (behind the
        last that cannot: an admission is a promise a later one does not break). Returns the requests
        it goes ahead of and the delay it adds to them."""
        floor = self._step_cap(request)
        decodes = min(len(self.running) + len(self.waiting), self._slot_capacity(floor))
        delay = prefill_delay(self.cost, request.num_tokens - request.num_computed_tokens,
                              self.config.max_num_batched_tokens, decodes, floor, self.config.min_prefill_chunk)
        key = request.sort_key()
        passed = [r for r in self.waiting if r.promised is not None and not r.num_output_tokens
                  and r.sort_key()[:2] == key[:2] and r.sort_key() > key]
        blocking = [r for r in passed if r.promised + delay > self._promise_by(r)]
        if blocking:
            request.due = max(r.due for r in blocking)
            passed = [r for r in passed if r.sort_key() > request.sort_key()]
        return passed, delay

    def _step_cap(self, request: Request) -> float:
        """The longest a step may take with ``request`` running, as far as its admission goes: the
        tightest TPOT target of its own and its tenant's running requests (inf: none has one)."""
        return self.tpot.binding_cap(request.tenant, self.tpot_target(request),
                                     ((r.tenant, self.tpot_target(r)) for r in self.running))

    def _slot_capacity(self, step_cap_s: float) -> int:
        """Running requests at once under ``step_cap_s`` (``_step_cap``; ``TpotPolicy.capacity``)."""
        return self.tpot.capacity(self.cost, step_cap_s)

    def _check_ttft(self, request: Request, ttft: float) -> float:
        """Seconds from now to ``request``'s first token, as estimated (SLOMissError: past what an
        admission may promise)."""
        now = self.clock()
        estimate = self.estimate_ttft(request)
        if now + estimate > self._promise_by(request):
            self.num_rejected[request.tenant] += 1
            expected = now + estimate - request.arrival_time
            raise SLOMissError(f"this request would get its first token in about {expected:.1f} s, "
                               f"{'over' if expected > ttft else 'too close to'} its time-to-first-token target "
                               f"of {ttft:g} s", max(1.0, expected - ttft))
        return estimate

    def _promise_by(self, request: Request) -> float:
        """The latest first token an admission may promise ``request`` (which has a TTFT target)."""
        return request.arrival_time + (1 - self.config.slo_headroom) * self.ttft_target(request)

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
        self._plan_prefill()
        out.promised = [r for r in self.waiting if r.promised is not None]
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        self._swap_in_pass(out)
        return out

    def _plan_prefill(self) -> None:
        """This step's prefill allowance: the token budget and, under a TPOT target among the running
        (``_prefill_room``), the time the decodes leave; the long prompts' part of it while a short one waits."""
        self._caps = {}  # kept up to date as this step admits requests
        for r in self.running:
            if (t := self.tpot_target(r)) is not None:
                self._caps[r.tenant] = min(self._caps.get(r.tenant, math.inf), t)
        self._token_room = self.config.max_num_batched_tokens
        self._decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        self._prefill_s = 0.0  # the prefill chunks taken so far this step, in the cost model's seconds
        room = self._token_room
        short_waiting = any(self._is_short(r) for r in self.waiting)
        self._long_room = int(room * (1 - self.config.short_lane_share)) if short_waiting else room

    def _prefill_room(self, request: Request) -> int:
        """Prefill tokens the step can still take for ``request``: within the token budget and, under
        its own or its tenant's running TPOT targets (another tenant's never cut its prefill),
        within the time the decodes and the chunks taken so far leave, each chunk charged its own
        cost as well (many short prompts cost more than one long one of their length); the first
        chunk at least ``min_prefill_chunk`` tokens, so prompts progress."""
        room = self._token_room
        cap = self.tpot.binding_cap(request.tenant, self.tpot_target(request), self._caps.items())
        if cap < math.inf:
            c = self.cost
            left = cap - c.base_s - c.per_decode_s * self._decodes - self._prefill_s - c.per_prefill_seq_s
            timed = int(left / max(c.per_prefill_token_s, 1e-9)) if left > 0 else 0
            if self._prefill_s == 0:
                timed = max(self.config.min_prefill_chunk, timed)
            room = min(room, timed)
        return room

    def _is_short(self, request: Request) -> bool:
        return request.num_tokens - request.num_computed_tokens <= self.config.short_prompt_tokens

    def _chunk(self, request: Request, budget: int, num_hit: int = 0) -> int:
        """Tokens to compute for ``request`` this step (a whole prompt, a chunk of it, or 1),
        within the step's prefill allowance (a long prompt: within its lane's)."""
        n = request.num_tokens - request.num_computed_tokens - num_hit
        if n <= 1:
            return min(n, budget)
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        if self.config.enable_chunked_prefill:  # without chunks a prompt goes whole: no allowance to cut it to
            room = self._prefill_room(request)
            n = min(n, room if self._is_short(request) else min(room, self._long_room))
        return max(0, min(n, budget))

    def _took_prefill(self, request: Request, n: int) -> None:
        if n > 1 or request.num_tokens - request.num_computed_tokens > 1:
            self._token_room -= n
            self._prefill_s += self.cost.per_prefill_token_s * n + self.cost.per_prefill_seq_s
            if not self._is_short(request):
                self._long_room -= n

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Decodes first (one token each, the TPOT they are owed), then unfinished prefill chunks,
        each in order of standing; a request that finds no KV room preempts the lowest-standing."""
        order = sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, r.sort_key()))
        for req in order:
            if budget <= 0:
                break
            if req not in self.running:  # preempted earlier in this pass
                continue
            n = self._chunk(req, budget)
            if n <= 0:
                continue  # a prefill chunk with no allowance left this step: the decodes go on
            while not self._allocate(req, n):
                victim = self._victim(req)
                self._preempt(victim, out)
                out.preempted.append(victim.request_id)
                budget += self._unschedule(out, victim)  # on a sort-key tie it may have run
                if victim is req:
                    n = 0
                    break
            if n:
                out.scheduled.append(ScheduledRequest(req, n, self.kv.get_block_ids(req.request_id)))
                self._took_prefill(req, n)
                budget -= n
        return budget

    def _victim(self, request: Request) -> Request:
        """Who gives its KV up so ``request`` can go on: the lowest-standing running request
        (batch first) among those drawing on the same pool. With reservations, a request within
        its tenant's share takes from those beyond theirs, and one beyond its share only from
        those beyond theirs too (never from a reservation)."""
        if self.reservations:
            used = self._usage()[0]
            over = [r for r in self.running if self._beyond_share(r, used)]
            if over:
                return max(over, key=Request.sort_key)
        return max(self.running, key=Request.sort_key)

    def _beyond_share(self, request: Request, used: dict[str, int]) -> bool:
        t = self.reservations.group(request.tenant)
        return t == "" or used.get(t, 0) > self.reservations.amount(t, self.kv.num_blocks)

    def _usage(self) -> tuple[dict[str, int], dict[str, int]]:
        """KV blocks and running slots in use, by reservation group ("" for the shared rest)."""
        blocks: Counter[str] = Counter()
        slots: Counter[str] = Counter()
        for r in self.running:
            g = self.reservations.group(r.tenant)
            blocks[g] += len(self.kv.req_blocks.get(r.request_id, ()))
            slots[g] += 1
        return blocks, slots

    def _allocate(self, request: Request, n: int, computed: KVCacheBlocks | None = None) -> bool:
        """Blocks for ``n`` more tokens of ``request``, leaving the other tenants' unused
        reservations free."""
        reserve = 0
        if self.reservations:
            blocks, _ = self._usage()
            reserve = self.reservations.held_back(self.reservations.group(request.tenant), self.kv.num_blocks, blocks)
        return self.kv.allocate_slots(request, n, computed, reserve=reserve) is not None

    @staticmethod
    def _unschedule(out: SchedulerOutput, request: Request) -> int:
        """Take a preempted ``request`` out of this step; the tokens it had from the budget."""
        for i, s in enumerate(out.scheduled):
            if s.request is request:
                del out.scheduled[i]
                return s.num_new_tokens
        return 0

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order while the budget, the slots and the KV allow. One that
        finds no room stays first in line and nothing that draws on the same pool jumps ahead of
        it (FCFS); a request on another tenant's reservation, or a short one passing a long prompt
        whose lane is spent this step, goes on."""
        blocked: set[str] = set()  # reservation groups (and tenants' TPOT bounds) that found no room this step
        yielded: set[str] = set()  # preempted this step for a higher class: not admitted again in it
        hits = False  # a request admitted this step took prefix-cache hits (maybe on blocks this step writes)
        long_spent = False
        i = 0
        while i < len(self.waiting) and budget > 0:
            req = self.waiting[i]
            group = self.reservations.group(req.tenant)
            if ({group, _tpot_key(req)} & blocked or req.request_id in yielded
                    or (long_spent and not self._is_short(req))):
                i += 1
                continue
            if (short := self._slot_shortage(req)) is not None:
                freed = self._yield_to(req, out, yielded, hits)
                if freed is None:
                    blocked.add(short)
                    i += 1
                else:  # a lower class gave its slot up: this request again (it is still at i)
                    budget += freed
                continue
            computed: KVCacheBlocks | None = None
            num_hit = 0
            if req.num_computed_tokens == 0:
                computed, num_hit = self.kv.get_computed_blocks(req)
            left = req.num_tokens - req.num_computed_tokens - num_hit
            if left > budget and not self.config.enable_chunked_prefill:
                break
            n = self._chunk(req, budget, num_hit)
            if n <= 0:
                if self._token_room <= 0:
                    break  # no prefill allowance left this step
                if self._is_short(req) or self._prefill_room(req) <= 0:
                    i += 1  # none for its tenant's TPOT targets: another tenant's may still go
                    continue
                long_spent = True  # the long lane is spent: short prompts behind it still go
                i += 1
                continue
            if not self._allocate(req, n, computed):
                freed = self._yield_to(req, out, yielded, hits)
                if freed is None:
                    blocked.add(group)  # no room: first in line for its pool
                    i += 1
                else:  # a lower class gave its KV up: this request again
                    budget += freed
                continue
            if req.num_cached_tokens < 0:  # first admitted (not a resumption after preemption)
                req.num_cached_tokens = num_hit
                self.kv.stats.record(req.num_tokens, num_hit)
            hits = hits or bool(computed)
            del self.waiting[i]
            req.num_computed_tokens += num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if (t := self.tpot_target(req)) is not None:
                self._caps[req.tenant] = min(self._caps.get(req.tenant, math.inf), t)
            out.scheduled.append(ScheduledRequest(req, n, self.kv.get_block_ids(req.request_id)))
            self._took_prefill(req, n)
            budget -= n

    def _yield_to(self, request: Request, out: SchedulerOutput, yielded: set[str], hits: bool) -> int | None:
        """Preempt the lowest-standing running request of a lower class than waiting ``request``
        (batch before escalation before interactive) that draws on the same pool, so ``request``
        gets its slot and its KV; the tokens it had in this step (None: there is none, nothing done).
        Once a request admitted this step took prefix-cache hits (``hits``), none scheduled this step
        is taken: the blocks it fills this step are in the cache already, and such a hit would read
        them unwritten."""
        group = self.reservations.group(request.tenant)
        planned = {s.request.request_id for s in out.scheduled} if hits else set()
        lower = [r for r in self.running if r.slo.rank > request.slo.rank
                 and self.reservations.group(r.tenant) == group and r.request_id not in planned]
        if not lower:
            return None
        victim = max(lower, key=Request.sort_key)
        self._preempt(victim, out)
        out.preempted.append(victim.request_id)
        yielded.add(victim.request_id)
        return self._unschedule(out, victim)

    def _slot_shortage(self, request: Request) -> str | None:
        """None when ``request`` may join the running set; else the pool nothing behind it may pass
        this step: its reservation group when max_num_seqs (less the other tenants' unused slot
        reservations) is reached, only its own tenant (``_tpot_key``) when its own or its tenant's
        TPOT targets keep it out (those of other tenants go on). Past its due time its own targets
        no longer keep it out: it runs best-effort rather than wait for a batch this small."""
        limit = self.config.max_num_seqs
        if self.reservations:
            _, slots = self._usage()
            limit -= self.reservations.held_back(self.reservations.group(request.tenant), self.config.max_num_seqs,
                                                 slots)
        if len(self.running) >= max(1, limit):
            return self.reservations.group(request.tenant)
        if len(self.running) >= self._slot_capacity(self._step_cap(request)) and not (
                request.due is not None and self.clock() >= request.due):
            return _tpot_key(request)
        return None

    # -- deadlines and targets -----------------------------------------------------------

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
        """Refuse the queued requests that have not started and whose TTFT target has passed, or whose
        promised first token has slipped past it: served they would count for nobody's goodput and
        delay those that still can make it."""
        for req in list(self.waiting):
            ttft = self.ttft_target(req)
            if ttft is None or req.num_output_tokens or req.num_preemptions:
                continue
            if now <= req.arrival_time + ttft and (req.promised is None or req.promised <= self._promise_by(req)):
                continue
            self.waiting.remove(req)
            self.num_rejected[req.tenant] += 1
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            out.rejected.append(req)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine's measured time of a step it ran: the cost model learns from it, and the
        first tokens promised to the queued requests move by what it took over (or under) its
        estimate (the steps of a burst's arrival run slower: the server parses it on the same cores)."""
        slip = seconds - self.cost.step_s(out.num_prefill_tokens, out.num_decodes, out.num_prefill_seqs)
        for r in out.promised:  # those queued when it was planned (a newcomer's estimate starts after it)
            if r.status == RequestStatus.WAITING:
                r.promised += slip
        self.cost.observe(out.num_prefill_tokens, out.num_decodes, seconds, out.num_prefill_seqs)

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

