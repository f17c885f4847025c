"""The pools running requests draw KV blocks and slots from: each reserved tenant's own share
(``Reservations``) and the shared rest (""). Who gives KV up for whom, and how many blocks an
allocation must leave free for the other tenants' unused reservations."""

from __future__ import annotations

from collections import Counter

from cloud_tier.engine.kv_cache_manager import KVCacheBlocks, KVCacheManager
from cloud_tier.engine.request import Request
from cloud_tier.engine.scheduling.tenants import Reservations


class TenantPools:
    """Reads the scheduler's ``running`` list (its own, never changed here) and allocates from ``kv``."""

    def __init__(self, reservations: Reservations, kv: KVCacheManager, running: list[Request], max_num_seqs: int):
        self.reservations = reservations
        self.kv = kv
        self.running = running
        self.max_num_seqs = max_num_seqs

    def group(self, request: Request) -> str:
        return self.reservations.group(request.tenant)

    def usage(self) -> tuple[dict[str, int], dict[str, int]]:
        """KV blocks and running slots in use, by reservation group ("" for the shared rest)."""
        blocks: Counter[str] = Counter()
        slots: Counter[str] = Counter()
        for r in self.running:
            g = self.reservations.group(r.tenant)
            blocks[g] += len(self.kv.req_blocks.get(r.request_id, ()))
            slots[g] += 1
        return blocks, slots

    def slot_limit(self, request: Request) -> int:
        """Running requests at once when ``request`` joins: max_num_seqs less the other tenants'
        unused slot reservations (at least one)."""
        limit = self.max_num_seqs
        if self.reservations:
            _, slots = self.usage()
            limit -= self.reservations.held_back(self.group(request), self.max_num_seqs, slots)
        return max(1, limit)

    def allocate(self, request: Request, n: int, computed: KVCacheBlocks | None = None) -> bool:
        """Blocks for ``n`` more tokens of ``request``, leaving the other tenants' unused
        reservations free."""
        reserve = 0
        if self.reservations:
            blocks, _ = self.usage()
            reserve = self.reservations.held_back(self.group(request), self.kv.num_blocks, blocks)
        return self.kv.allocate_slots(request, n, computed, reserve=reserve) is not None

    def victim(self) -> Request:
        """Who gives its KV up so a running request can go on: the lowest-standing running request
        (batch first) among those drawing on the same pool. With reservations, a request within
        its tenant's share takes from those beyond theirs, and one beyond its share only from
        those beyond theirs too (never from a reservation)."""
        if self.reservations:
            used = self.usage()[0]
            over = [r for r in self.running if self._beyond_share(r, used)]
            if over:
                return max(over, key=Request.sort_key)
        return max(self.running, key=Request.sort_key)

    def _beyond_share(self, request: Request, used: dict[str, int]) -> bool:
        t = self.reservations.group(request.tenant)
        return t == "" or used.get(t, 0) > self.reservations.amount(t, self.kv.num_blocks)
