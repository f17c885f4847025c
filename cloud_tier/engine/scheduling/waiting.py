"""The waiting pass: admit waiting requests in order while the budget, the slots and the KV allow.

One that finds no room stays first in line and nothing that draws on the same pool jumps ahead
of it (FCFS); a request on another tenant's reservation, or a short one passing a long prompt
whose lane is spent this step, goes on. A waiting request of a higher class takes the slot and
the KV of a running one of a lower class (``_yield_to``).
"""

from __future__ import annotations

import enum

from cloud_tier.engine.kv_cache_manager import KVCacheBlocks, KVCacheManager
from cloud_tier.engine.request import Request, RequestStatus
from cloud_tier.engine.scheduling.admission import SloAdmission
from cloud_tier.engine.scheduling.budget import StepBudget, is_short, tokens_left
from cloud_tier.engine.scheduling.output import ScheduledRequest, SchedulerOutput
from cloud_tier.engine.scheduling.pools import TenantPools
from cloud_tier.engine.scheduling.running import Preempt


class Next(enum.Enum):
    """What the pass does after considering the request at its place in line."""

    PASS = enum.auto()  # leave it waiting and look at the one behind it
    AGAIN = enum.auto()  # the same place again: it was admitted, or a lower class made room for it
    STOP = enum.auto()  # nothing more this step


def tpot_pool(request: Request) -> str:
    """The blocked-pool key of a tenant held out by its own TPOT targets (never a reservation group's)."""
    return f"\0tpot:{request.tenant}"


class WaitingPass:
    def __init__(self, waiting: list[Request], running: list[Request], kv: KVCacheManager, pools: TenantPools,
                 admission: SloAdmission, budget: StepBudget, out: SchedulerOutput, preempt: Preempt):
        self.waiting, self.running, self.kv, self.pools = waiting, running, kv, pools
        self.admission, self.budget, self.out, self.preempt = admission, budget, out, preempt
        self.config = admission.config
        self.blocked: set[str] = set()  # pools (reservation groups, tenants' TPOT bounds) that found no room
        self.yielded: set[str] = set()  # preempted this step for a higher class: not admitted again in it
        # a request admitted this step took prefix-cache hits, maybe on blocks this step writes
        self.took_prefix_hits = False
        self.long_lane_spent = False  # no long prompt goes this step: short ones behind it still do

    def run(self) -> None:
        i = 0
        while i < len(self.waiting) and not self.budget.spent:
            step = self._consider(i, self.waiting[i])
            if step is Next.STOP:
                break
            if step is Next.PASS:
                i += 1

    def _passed_over(self, request: Request) -> bool:
        """Behind one of its pools' first in line, preempted for a higher class this step, or a
        long prompt once the long lane is spent."""
        return bool({self.pools.group(request), tpot_pool(request)} & self.blocked
                    or request.request_id in self.yielded
                    or (self.long_lane_spent and not is_short(request, self.config)))

    def _consider(self, i: int, request: Request) -> Next:
        if self._passed_over(request):
            return Next.PASS
        if (pool := self._slot_shortage(request)) is not None:
            return self._make_way(request, pool)
        computed: KVCacheBlocks | None = None
        num_hit = 0
        if request.num_computed_tokens == 0:
            computed, num_hit = self.kv.get_computed_blocks(request)
        if tokens_left(request) - num_hit > self.budget.tokens and not self.config.enable_chunked_prefill:
            return Next.STOP
        n = self.budget.chunk(request, num_hit)
        if n <= 0:
            return self._no_allowance(request)
        if not self.pools.allocate(request, n, computed):
            return self._make_way(request, self.pools.group(request))  # no room: first in line for its pool
        self._admit(i, request, n, computed, num_hit)
        return Next.AGAIN

    def _no_allowance(self, request: Request) -> Next:
        """No prefill for ``request`` this step: none left at all, none under its tenant's TPOT
        targets (another tenant's may still go), or the long lane is spent (short prompts go on)."""
        if self.budget.prefill_spent:
            return Next.STOP
        if not is_short(request, self.config) and self.budget.prefill_room(request) > 0:
            self.long_lane_spent = True
        return Next.PASS

    def _make_way(self, request: Request, pool: str) -> Next:
        """A lower class gives its place up for ``request`` (then it is considered again), or
        ``pool`` is blocked behind it for the rest of this step."""
        freed = self._yield_to(request)
        if freed is None:
            self.blocked.add(pool)
            return Next.PASS
        self.budget.give_back(freed)
        return Next.AGAIN

    def _admit(self, i: int, request: Request, n: int, computed: KVCacheBlocks | None, num_hit: int) -> None:
        if request.num_cached_tokens < 0:  # first admitted (not a resumption after preemption)
            request.num_cached_tokens = num_hit
            self.kv.stats.record(request.num_tokens, num_hit)
        self.took_prefix_hits = self.took_prefix_hits or bool(computed)
        del self.waiting[i]
        request.num_computed_tokens += num_hit
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.budget.cap(request)
        self.out.scheduled.append(ScheduledRequest(request, n, self.kv.get_block_ids(request.request_id)))
        self.budget.take(request, n)

    def _yield_to(self, request: Request) -> int | None:
        """Preempt the lowest-standing running request of a lower class than waiting ``request``
        (batch before escalation before interactive) that draws on the same pool, so ``request``
        gets its slot and its KV; the tokens it had in this step (None: there is none, nothing done).
        Once a request admitted this step took prefix-cache hits, none scheduled this step is
        taken: the blocks it fills this step are in the cache already, and such a hit would read
        them unwritten."""
        group = self.pools.group(request)
        planned = {s.request.request_id for s in self.out.scheduled} if self.took_prefix_hits else set()
        lower = [r for r in self.running if r.slo.rank > request.slo.rank
                 and self.pools.group(r) == group and r.request_id not in planned]
        if not lower:
            return None
        victim = max(lower, key=Request.sort_key)
        freed = self.preempt(victim, self.out)
        self.yielded.add(victim.request_id)
        return freed

    def _slot_shortage(self, request: Request) -> str | None:
        """None when ``request`` may join the running set; else the pool nothing behind it may pass
        this step: its reservation group when max_num_seqs (less the other tenants' unused slot
        reservations) is reached, only its own tenant (``tpot_pool``) when its own or its tenant's
        TPOT targets keep it out (those of other tenants go on). Past its due time its own targets
        no longer keep it out: it runs best-effort rather than wait for a batch this small."""
        if len(self.running) >= self.pools.slot_limit(request):
            return self.pools.group(request)
        admission = self.admission
        if len(self.running) >= admission.slot_capacity(admission.step_cap(request)) and not (
                request.due is not None and admission.clock() >= request.due):
            return tpot_pool(request)
        return None
