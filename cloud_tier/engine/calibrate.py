"""Teach the scheduler's step-cost model this machine's speed before the first request (a server
does this once at start): steps of one decode, of several decodes, of a prefill and of both, each
timed at its best of a few runs after a warm-up, over free blocks of the cache (nothing is cached
yet: the KV written is never read). Without it the model starts from a prior and learns from the
first steps, too late for the TTFT estimates of a burst that comes at once."""

from __future__ import annotations

import logging
import time

from cloud_tier.engine.kv_cache_manager import KVCacheManager
from cloud_tier.engine.model_runner import ModelRunner
from cloud_tier.engine.request import Request
from cloud_tier.engine.scheduler import Scheduler
from cloud_tier.engine.scheduling.output import ScheduledRequest, SchedulerOutput
from cloud_tier.sampling import SamplingParams

log = logging.getLogger(__name__)


def calibrate_step_cost(runner: ModelRunner, kv: KVCacheManager, scheduler: Scheduler, max_model_len: int,
                        prefill_tokens: int = 128, decodes: int = 8, context: int = 32, repeats: int = 3) -> None:
    prefill_tokens = min(prefill_tokens, max_model_len - 1, kv.num_blocks * kv.block_size // 2)
    per_decode = kv.blocks_for_tokens(context)
    decodes = max(2, min(decodes, (kv.num_blocks - kv.blocks_for_tokens(prefill_tokens)) // per_decode))
    if (kv.num_free_blocks < kv.num_blocks or prefill_tokens < 2 or context >= max_model_len
            or kv.window is not None):
        return  # the cache is in use (or too small, or in two groups): learn from the steps instead
    steps = _calibration_steps(kv, prefill_tokens, decodes, context, per_decode)
    try:
        for scheduled in steps:
            out = SchedulerOutput(scheduled=scheduled)
            times = []
            for _ in range(repeats + 1):
                started = time.perf_counter()
                runner.execute(out)
                times.append(time.perf_counter() - started)
            for _ in range(4):  # worth a few steps: the first requests' estimates lean on it
                scheduler.observe_step(out, min(times[1:]))
    finally:
        for rid in {s.request.request_id for scheduled in steps for s in scheduled}:
            runner.sampler.forget(rid)
    c = scheduler.cost
    log.info("step cost: %.1f ms + %.3f ms per prefill token + %.2f ms per prefill chunk + %.2f ms per decode",
             1e3 * c.base_s, 1e3 * c.per_prefill_token_s, 1e3 * c.per_prefill_seq_s, 1e3 * c.per_decode_s)


def _calibration_steps(kv: KVCacheManager, prefill_tokens: int, decodes: int, context: int,
                       per_decode: int) -> list[list[ScheduledRequest]]:
    """One decode; ``decodes`` decodes; a prefill; half a prefill beside the decodes; four short
    prompts in one step (what each prefill chunk costs beyond its tokens)."""
    blocks = iter(range(kv.num_blocks))
    prefill = Request("calibrate-prefill", [0] * prefill_tokens, SamplingParams(temperature=0.0))
    prefill_blocks = [next(blocks) for _ in range(kv.blocks_for_tokens(prefill_tokens))]
    decoding = []
    for i in range(decodes):
        r = Request(f"calibrate-decode-{i}", [0] * context, SamplingParams(temperature=0.0))
        r.num_computed_tokens = context - 1
        decoding.append(ScheduledRequest(r, 1, [next(blocks) for _ in range(per_decode)]))
    half = ScheduledRequest(prefill, prefill_tokens // 2, prefill_blocks)
    quarter = min(context, max(2, prefill_tokens // 4))
    chunks = [ScheduledRequest(Request(f"calibrate-chunk-{i}", [0] * quarter, SamplingParams(temperature=0.0)),
                               quarter, d.block_ids) for i, d in enumerate(decoding[:4])]
    return [decoding[:1], decoding, [ScheduledRequest(prefill, prefill_tokens, prefill_blocks)], [half, *decoding],
            chunks]
