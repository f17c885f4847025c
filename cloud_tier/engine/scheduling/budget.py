"""One step's budget: the tokens it may still take, the prefill within them (under the running
TPOT targets, in the cost model's seconds), and the long prompts' lane while a short one waits.

A value the passes of one ``schedule()`` share and draw down (``take``), built fresh each step
(``StepBudget.plan``): nothing of it outlives the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cloud_tier.engine.request import Request
from cloud_tier.engine.scheduling.step_cost import StepCostModel
from cloud_tier.engine.scheduling.tenants import TpotPolicy
from cloud_tier.engine_config import SchedulerConfig


def tokens_left(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


def is_short(request: Request, config: SchedulerConfig) -> bool:
    """Whether ``request``'s prompt left to compute is in the short lane."""
    return tokens_left(request) <= config.short_prompt_tokens


@dataclass
class StepBudget:
    config: SchedulerConfig
    cost: StepCostModel
    tpot: TpotPolicy
    tpot_target: Callable[[Request], float | None]  # a request's TPOT target as served
    tokens: int  # the step's tokens left, decodes and prefill alike
    prefill_tokens: int  # of them, the prefill allowance left
    long_tokens: int  # of that, what long prompts may still take while a short one waits
    decodes: int  # the running decodes this step carries
    caps: dict[str, float] = field(default_factory=dict)  # by tenant: the tightest TPOT target running
    prefill_s: float = 0.0  # the prefill chunks taken so far, in the cost model's seconds

    @classmethod
    def plan(cls, config: SchedulerConfig, cost: StepCostModel, tpot: TpotPolicy,
             tpot_target: Callable[[Request], float | None], running: Iterable[Request],
             waiting: Iterable[Request]) -> StepBudget:
        """This step's allowance: the token budget, the decodes it carries and the running TPOT
        targets; the long prompts' part of it while a short one waits."""
        running = list(running)
        room = config.max_num_batched_tokens
        short_waiting = any(is_short(r, config) for r in waiting)
        budget = cls(config, cost, tpot, tpot_target, tokens=room, prefill_tokens=room,
                     long_tokens=int(room * (1 - config.short_lane_share)) if short_waiting else room,
                     decodes=sum(1 for r in running if tokens_left(r) == 1))
        for r in running:
            budget.cap(r)
        return budget

    @property
    def spent(self) -> bool:
        return self.tokens <= 0

    @property
    def prefill_spent(self) -> bool:
        return self.prefill_tokens <= 0

    def cap(self, request: Request) -> None:
        """``request`` runs from now on: its TPOT target bounds its tenant's prefill this step."""
        if (t := self.tpot_target(request)) is not None:
            self.caps[request.tenant] = min(self.caps.get(request.tenant, math.inf), t)

    def prefill_room(self, request: Request) -> int:
        """Prefill tokens the step can still take for ``request``: within the token budget and, under
        its own or its tenant's running TPOT targets (another tenant's never cut its prefill),
        within the time the decodes and the chunks taken so far leave, each chunk charged its own
        cost as well (many short prompts cost more than one long one of their length); the first
        chunk at least ``min_prefill_chunk`` tokens, so prompts progress."""
        room = self.prefill_tokens
        cap = self.tpot.binding_cap(request.tenant, self.tpot_target(request), self.caps.items())
        if cap < math.inf:
            c = self.cost
            left = cap - c.base_s - c.per_decode_s * self.decodes - self.prefill_s - c.per_prefill_seq_s
            timed = int(left / max(c.per_prefill_token_s, 1e-9)) if left > 0 else 0
            if self.prefill_s == 0:
                timed = max(self.config.min_prefill_chunk, timed)
            room = min(room, timed)
        return room

    def chunk(self, request: Request, num_hit: int = 0) -> int:
        """Tokens to compute for ``request`` this step (a whole prompt, a chunk of it, or 1),
        within the step's prefill allowance (a long prompt: within its lane's)."""
        n = tokens_left(request) - num_hit
        if n <= 1:
            return min(n, self.tokens)
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        if self.config.enable_chunked_prefill:  # without chunks a prompt goes whole: no allowance to cut it to
            room = self.prefill_room(request)
            n = min(n, room if is_short(request, self.config) else min(room, self.long_tokens))
        return max(0, min(n, self.tokens))

    def take(self, request: Request, n: int) -> None:
        """``n`` tokens of ``request`` run this step (a prefill chunk also draws on the prefill
        allowance, its time and, for a long prompt, its lane)."""
        if n > 1 or tokens_left(request) > 1:
            self.prefill_tokens -= n
            self.prefill_s += self.cost.per_prefill_token_s * n + self.cost.per_prefill_seq_s
            if not is_short(request, self.config):
                self.long_tokens -= n
        self.tokens -= n

    def give_back(self, n: int) -> None:
        """The tokens of a request preempted after it was scheduled this step."""
        self.tokens += n
