"""The running pass: decodes first (one token each, the TPOT they are owed), then unfinished
prefill chunks, each in order of standing; a request that finds no KV room preempts the
lowest-standing running request of its pool (``TenantPools.victim``), itself if need be."""

from __future__ import annotations

from collections.abc import Callable

from cloud_tier.engine.request import Request
from cloud_tier.engine.scheduling.budget import StepBudget, tokens_left
from cloud_tier.engine.scheduling.output import ScheduledRequest, SchedulerOutput
from cloud_tier.engine.scheduling.pools import TenantPools

# preempt(victim, out): requeue ``victim`` (its KV swapped out or dropped), out of this step; its tokens
Preempt = Callable[[Request, SchedulerOutput], int]


def schedule_running(running: list[Request], pools: TenantPools, budget: StepBudget, out: SchedulerOutput,
                     preempt: Preempt) -> None:
    for req in sorted(running, key=lambda r: (tokens_left(r) > 1, r.sort_key())):
        if budget.spent:
            break
        if req not in running:  # preempted earlier in this pass
            continue
        n = budget.chunk(req)
        if n <= 0:
            continue  # a prefill chunk with no allowance left this step: the decodes go on
        if make_room(req, n, pools, budget, out, preempt):
            out.scheduled.append(ScheduledRequest(req, n, pools.kv.get_block_ids(req.request_id)))
            budget.take(req, n)


def make_room(request: Request, n: int, pools: TenantPools, budget: StepBudget, out: SchedulerOutput,
              preempt: Preempt) -> bool:
    """Blocks for ``n`` more tokens of running ``request``, preempting victims until they fit;
    False when ``request`` itself was the victim."""
    while not pools.allocate(request, n):
        victim = pools.victim()
        budget.give_back(preempt(victim, out))  # on a sort-key tie it may have run this step
        if victim is request:
            return False
    return True
