"""Preemption by cost: swap a victim's KV out to host memory, or drop it and recompute it later,
whichever is cheaper for that request.

The scheduler asks ``SwapSpace.choose`` in its ``_preempt`` and lists the swap-outs and swap-ins
in its output; the engine moves the bytes before the step's forward (reads first, then writes,
so a block freed by a swap-out and reused in the same step is read before it is overwritten).
No torch here: payloads are opaque (whatever the runner's ``read_blocks`` returns).
"""

from __future__ import annotations

from dataclasses import dataclass

from cloud_tier.engine_config import PREEMPTION_MODES


def choose_preemption(mode: str, swap_bytes: int, swap_free_bytes: int, copy_s_per_byte: float | None,
                      recompute_tokens: int, prefill_s_per_token: float | None) -> str:
    """"swap" or "recompute" for one victim. Swapping costs its bytes out and back in (a round
    trip measured at start); recompute costs a prefill of the tokens it had computed (an EMA of
    the engine's steps). A swap that does not fit the swap space is a recompute, whatever the
    mode; so is one whose cost is unknown yet in "auto" mode."""
    if mode == "recompute" or recompute_tokens == 0 or swap_bytes > swap_free_bytes:
        return "recompute"
    if mode == "swap":
        return "swap"
    if copy_s_per_byte is None or prefill_s_per_token is None:
        return "recompute"
    return "swap" if swap_bytes * copy_s_per_byte < recompute_tokens * prefill_s_per_token else "recompute"


@dataclass
class SwapStats:
    by_swap: int = 0
    by_recompute: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0


@dataclass(frozen=True)
class SwapOut:
    request_id: str
    block_ids: tuple[int, ...]  # the blocks holding its computed tokens, in order, read before the step


@dataclass(frozen=True)
class SwapIn:
    request_id: str
    block_ids: tuple[int, ...]  # its new blocks for the swapped tokens, written before the step


class SwapSpace:
    """The host-side store of swapped-out requests' KV within a byte budget: the scheduler
    reserves the bytes when it decides (``choose``), the engine stores the payload (``put``)
    and takes it back at swap-in (``take``) or drops it when the request ends (``drop``)."""

    def __init__(self, mode: str = "recompute", budget_bytes: int = 0, bytes_per_block: int = 0,
                 smoothing: float = 0.2):
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {mode!r}")
        self.mode = mode
        self.budget_bytes = budget_bytes
        self.bytes_per_block = bytes_per_block
        self.copy_s_per_byte: float | None = None  # measured once at start
        self.prefill_s_per_token: float | None = None  # EMA of the engine's prefill steps
        self.smoothing = smoothing
        self.reserved: dict[str, int] = {}  # request id -> blocks swapped out and not yet back in
        self.payloads: dict[str, object] = {}
        self.stats = SwapStats()

    @property
    def used_bytes(self) -> int:
        return sum(self.reserved.values()) * self.bytes_per_block

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.reserved

    def observe_prefill(self, seconds: float, num_tokens: int) -> None:
        """Fold one step's prefill time per token into the estimate."""
        if num_tokens <= 0:
            return
        per_token = seconds / num_tokens
        prev = self.prefill_s_per_token
        self.prefill_s_per_token = per_token if prev is None else prev + self.smoothing * (per_token - prev)

    def choose(self, request_id: str, num_blocks: int, num_computed_tokens: int) -> str:
        """Decide for one victim; a "swap" reserves its bytes until ``take`` or ``drop``."""
        nbytes = num_blocks * self.bytes_per_block
        kind = choose_preemption(self.mode, nbytes, self.budget_bytes - self.used_bytes, self.copy_s_per_byte,
                                 num_computed_tokens, self.prefill_s_per_token)
        if kind == "swap":
            self.reserved[request_id] = num_blocks
            self.stats.by_swap += 1
            self.stats.swapped_out_bytes += nbytes
        else:
            self.stats.by_recompute += 1
        return kind

    def num_blocks(self, request_id: str) -> int:
        return self.reserved[request_id]

    def put(self, request_id: str, payload: object) -> None:
        self.payloads[request_id] = payload

    def take(self, request_id: str) -> object:
        """The payload of a request being swapped in; its reservation ends."""
        self.stats.swapped_in_bytes += self.reserved.pop(request_id) * self.bytes_per_block
        return self.payloads.pop(request_id)

    def drop(self, request_id: str) -> None:
        """Forget a request that ended while swapped out (aborted, failed)."""
        self.reserved.pop(request_id, None)
        self.payloads.pop(request_id, None)
