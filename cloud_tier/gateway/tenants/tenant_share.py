"""Fair shares of the decode pool's KV between tenants, a pass of the gateway's KV admission.

A tenant is *active* while it holds KV blocks or waits for them, and for ``window_s`` after its
last request ended; each active tenant's share is an equal part of the pool. What an active
tenant wants (the most it held and waited for at once since it became active) is kept free for it,
up to its share, and no other tenant's request may take that room. So a tenant flooding the pool
with long prompts leaves room for another tenant's requests to start at once; and where the flood
took the room before the other tenant came, the other tenant's waiting requests get the room
released next, ahead of the flood's. A tenant holding nothing may always start one request where
it fits, so a request larger than a share still runs. Batch-class requests are outside this pass
(online requests may take their blocks anyway; batch slots have fair shares of their own)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Tenant:
    held: int = 0  # blocks its online requests in flight hold
    waiting: int = 0  # blocks its requests waiting for room need
    wanted: int = 0  # the most it held and waited for at once while active
    last: float = 0.0  # when it last held or waited for anything


class TenantShares:
    """Online KV blocks held and wanted per tenant, and whether a tenant may take more now."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        if window_s < 0:
            raise ValueError(f"tenant_kv_window_s must be >= 0, got {window_s}")
        self.window_s = window_s
        self.clock = clock
        self._tenants: dict[str, _Tenant] = {}

    def took(self, tenant: str, blocks: int) -> None:
        """An online request of ``tenant`` was admitted with ``blocks``."""
        t = self._get(tenant)
        t.held += blocks
        self._touch(t)

    def gave_back(self, tenant: str, blocks: int) -> None:
        """An online request of ``tenant`` ended and released ``blocks``."""
        t = self._tenants.get(tenant)
        if t is None:  # a ticket this pass never counted
            return
        t.held = max(0, t.held - blocks)
        self._touch(t)

    def wait(self, tenant: str, blocks: int) -> None:
        """A request of ``tenant`` needing ``blocks`` waits for room (until ``unwait``)."""
        t = self._get(tenant)
        t.waiting += blocks
        self._touch(t)

    def unwait(self, tenant: str, blocks: int) -> None:
        t = self._tenants.get(tenant)
        if t is None:
            return
        t.waiting = max(0, t.waiting - blocks)
        self._touch(t)

    def allows(self, tenant: str, need: int, free_blocks: int, pool_blocks: int) -> bool:
        """Whether ``tenant`` may take ``need`` of the ``free_blocks`` left (under the watermark) of
        ``pool_blocks`` now: what is left after it must cover the room kept for the other active
        tenants, unless ``tenant`` holds nothing (its one request goes where it fits)."""
        mine = self._tenants.get(tenant)
        if mine is None or mine.held == 0:
            return True
        return free_blocks - need >= self.kept_for_others(tenant, pool_blocks)

    def kept_for_others(self, tenant: str, pool_blocks: int) -> int:
        """Blocks kept free for the active tenants other than ``tenant``: what each wants, up to its
        share, less what it holds."""
        active = self._active()
        if tenant not in active:
            active[tenant] = self._get(tenant)
        share = pool_blocks / len(active)
        return sum(max(0, int(min(share, t.wanted)) - t.held) for name, t in active.items() if name != tenant)

    def held(self, tenant: str) -> int:
        t = self._tenants.get(tenant)
        return t.held if t else 0

    def _active(self) -> dict[str, _Tenant]:
        """The active tenants; the others are forgotten (what they wanted starts again from 0)."""
        now = self.clock()
        for name in [n for n, t in self._tenants.items()
                     if t.held == 0 and t.waiting == 0 and now - t.last > self.window_s]:
            del self._tenants[name]
        return dict(self._tenants)

    def _get(self, tenant: str) -> _Tenant:
        self._active()
        return self._tenants.setdefault(tenant, _Tenant(last=self.clock()))

    def _touch(self, t: _Tenant) -> None:
        t.wanted = max(t.wanted, t.held + t.waiting)
        t.last = self.clock()
