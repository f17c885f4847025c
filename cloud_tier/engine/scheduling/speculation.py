"""The speculation pass: after the running and waiting passes, a scheduled request that samples
this step and has proposed tokens (a device's draft, the engine's own n-gram proposal) computes
them too, as far as the step's leftover budget, its KV room, its context and its max_tokens allow;
the step then verifies them (``cloud_tier/engine/spec/verify.py``). No preemption for them: a
proposal that finds no room waits (a draft is verified in part, or refused when nothing of it fits)."""

from __future__ import annotations

from cloud_tier.engine.request import Request
from cloud_tier.engine.scheduling.budget import StepBudget
from cloud_tier.engine.scheduling.output import ScheduledRequest, SchedulerOutput
from cloud_tier.engine.scheduling.pools import TenantPools


def spec_room(request: Request, max_model_len: int) -> int:
    """The most proposed tokens one step of ``request`` can use: each accepted one is an output
    token and a step adds one more (the bonus), within max_tokens and the model's context."""
    p = request.sampling_params
    return max(0, min(p.max_tokens - request.num_output_tokens - 1, max_model_len - request.num_tokens - 1))


def schedule_speculation(out: SchedulerOutput, pools: TenantPools, budget: StepBudget, max_model_len: int) -> None:
    for i, s in enumerate(out.scheduled):
        req = s.request
        spec = req.spec
        if not spec.token_ids or not s.samples:
            continue  # nothing proposed, or a prefill chunk short of the prompt's end: it waits
        if req.kv_transfer:  # the handoff carries the prompt's KV and one token, nothing more
            spec.refuse("kv_transfer")
            continue
        k = min(len(spec.token_ids), spec_room(req, max_model_len), max(0, budget.tokens))
        if k and not pools.allocate(req, s.num_new_tokens + k):
            k = 0
        if k == 0:
            spec.refuse("no_room")
            continue
        proposed = tuple(spec.token_ids[:k])
        out.scheduled[i] = ScheduledRequest(req, s.num_new_tokens + k, pools.kv.get_block_ids(req.request_id), proposed)
        budget.take(req, k)
