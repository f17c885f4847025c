"""What tenants may ask of a shared engine: reservations of KV blocks and running slots
(``Reservations``), and the floor a TPOT target is served at (``TpotPolicy``). Plain values:
the scheduler's passes ask them, tested as tables."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from cloud_tier.engine.scheduling.step_cost import StepCostModel
from cloud_tier.engine_config import parse_reservations


@dataclass(frozen=True)
class Reservations:
    """Per-tenant shares of the KV blocks and of the running slots that another tenant's flood
    cannot take: ``"gold=0.3,silver=0.1"``. A tenant with a share uses it first, then the shared
    rest like anyone; tenants with none (or no tenant named) share what is not reserved. An unused
    share is kept free for its tenant, so a burst of theirs starts at once, not after a preemption."""

    shares: dict[str, float]

    @classmethod
    def parse(cls, text: str) -> Reservations:
        return cls(parse_reservations(text))

    def __bool__(self) -> bool:
        return bool(self.shares)

    def group(self, tenant: str) -> str:
        """The pool a tenant draws on: its own reservation, or the shared rest ("")."""
        return tenant if tenant in self.shares else ""

    def amount(self, tenant: str, total: int) -> int:
        return int(self.shares.get(tenant, 0.0) * total)

    def held_back(self, tenant: str, total: int, used: dict[str, int]) -> int:
        """How much of ``total`` the *other* tenants' unused reservations keep from ``tenant``."""
        return sum(max(0, int(share * total) - used.get(name, 0))
                   for name, share in self.shares.items() if name != tenant)


@dataclass(frozen=True)
class TpotPolicy:
    """What a TPOT target may ask of an engine that serves everyone (issue 37 item 3).

    - A target is served no tighter than ``floor``: the longer of ``min_tpot_s`` and a step of
      ``min_batch`` decodes (as measured); a tighter one is served best-effort at the floor.
    - A target bounds the running batch only for its own tenant's newcomers (and a newcomer's
      own target bounds itself), never below ``min_batch``: one tenant's targets do not cut the
      batch another tenant's requests run in.
    """

    min_batch: int
    min_tpot_s: float
    max_num_seqs: int

    def floor(self, cost: StepCostModel) -> float:
        return max(self.min_tpot_s, cost.step_s(0, min(self.min_batch, self.max_num_seqs)))

    def effective(self, target: float | None, cost: StepCostModel) -> float | None:
        """``target`` as served: raised to the floor (None: no target)."""
        return None if target is None else max(target, self.floor(cost))

    def capacity(self, cost: StepCostModel, step_cap_s: float) -> int:
        """Running requests at once under a step of at most ``step_cap_s``: max_num_seqs, fewer
        when one step of them all would take longer, never fewer than ``min_batch``."""
        if step_cap_s == math.inf:
            return self.max_num_seqs
        return min(self.max_num_seqs, max(self.min_batch, cost.decodes_within(step_cap_s)))

    @staticmethod
    def binding_cap(tenant: str, own_target: float | None, running: Iterable[tuple[str, float | None]]) -> float:
        """The longest a step may take with a newcomer of ``tenant`` running: the tightest of its
        own (effective) target and those of its own tenant's running requests (inf: none)."""
        caps = [t for name, t in running if t is not None and name == tenant]
        if own_target is not None:
            caps.append(own_target)
        return min(caps, default=math.inf)
