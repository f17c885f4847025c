"""Overflow: escalate instead of queueing when the local queue's predicted wait plus the
generation time would exceed the request's latency budget, or when the local queue is full."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadSignals:
    waiting: int  # requests queued ahead of this one
    free_slots: int
    service_time_s: float  # moving average of one request's slot time
    decode_tok_s: float  # local decode speed
    max_tokens: int


def predicted_latency_s(load: LoadSignals) -> float:
    """Queue wait (the requests ahead, one service time each, shared by the slots) + generation."""
    wait = 0.0 if load.free_slots > 0 else (load.waiting + 1) * load.service_time_s
    gen = load.max_tokens / load.decode_tok_s if load.decode_tok_s > 0 else 0.0
    return wait + gen


def overflows(load: LoadSignals, budget_s: float | None) -> bool:
    return budget_s is not None and budget_s > 0 and predicted_latency_s(load) > budget_s


def overflow_on_full_queue(reason: str, upstream: bool, cloud_available: bool) -> bool:
    """The local queue refused a request: the cloud takes it instead when it would have been
    answered here only because it looked easy (a request kept local on purpose, or one that
    already failed to escalate, is refused with the queue's 429)."""
    return reason == "easy" and upstream and cloud_available
