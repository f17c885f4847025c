"""The prefill side: run a prompt (prefix cache and chunked prefill as usual), sample its first
token, send the request's KV blocks and record to the decode worker, then free them here (they
stay in this worker's prefix cache for the next prompt that shares them)."""

from __future__ import annotations

import asyncio
import logging
import time

from cloud_tier.disagg.messages import RequestRecord, TransferHeader
from cloud_tier.disagg.protocol import PrefillRequest, PrefillResponse
from cloud_tier.disagg.records import arrival_of, logprob_record, params_of, service_level_of
from cloud_tier.disagg.transport import (
    KVSender,
    ShmSender,
    TcpSender,
    TransferError,
    tensor_payload,
)
from cloud_tier.engine.async_engine import AsyncLLMEngine
from cloud_tier.engine.llm_engine import KVHandoff
from cloud_tier.engine.scheduling.admission import SLOMissError

log = logging.getLogger(__name__)


class PrefillService:
    def __init__(self, engine: AsyncLLMEngine, timeout_s: float = 30.0):
        self.engine = engine
        self.senders: dict[str, KVSender] = {"tcp": TcpSender(timeout_s), "shm": ShmSender(timeout_s)}
        self.transferred_bytes = 0
        self.transfers_ok = 0
        self.failed_transfers = 0
        self.in_flight = 0
        self.cancelled = 0

    async def prefill(self, body: PrefillRequest) -> PrefillResponse:
        """Prefill ``body.record`` and send its KV to ``body.kv_target`` with the record's
        transfer token. Cancelling it (its caller went away) aborts the engine request and frees
        its blocks wherever it is: queued, prefilling, or held for the transfer."""
        self.in_flight += 1
        try:
            return await self._prefill(body)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1

    async def _prefill(self, body: PrefillRequest) -> PrefillResponse:
        rec = body.record
        rid = rec.request_id
        started = time.perf_counter()
        try:
            req = self.engine.prepare(rec.prompt_token_ids, params_of(rec), rid, rec.priority, service_level_of(rec),
                                      arrival_of(rec))
        except (ValueError, TypeError) as e:
            return PrefillResponse(request_id=rid, ok=False, code="bad_request", message=str(e))
        rid = req.request_id  # the engine names a request that came without an id
        req.kv_transfer = True
        final = None
        try:
            async for out in self.engine.stream(req):
                final = out
        except SLOMissError as e:  # it would miss its TTFT target: the decode worker answers 429
            return PrefillResponse(request_id=rid, ok=False, code="slo", message=str(e))
        prefill_ms = (time.perf_counter() - started) * 1e3
        first = rec.model_copy(update={
            "request_id": rid, "transfer_token": "", "output_token_ids": list(final.token_ids),
            "logprobs": [logprob_record(lp) for lp in final.new_logprobs],
            "num_cached_tokens": max(req.num_cached_tokens, 0)})
        if final.finish_reason != "transfer":  # it ended on its first token: nothing to hand over
            first.finish_reason = final.finish_reason
            return PrefillResponse(request_id=rid, ok=True, record=first, text=final.text, prefill_ms=prefill_ms)
        try:
            handoff: KVHandoff = await self.engine.call(lambda e: e.export_kv(rid))
            first.sampler_state = handoff.sampler_state
            return await self._send(body, first, rec.transfer_token, handoff, prefill_ms)
        finally:
            self.engine.abort(rid)  # frees the held blocks, whatever happened (also if cancelled)

    async def _send(self, body: PrefillRequest, record: RequestRecord, token: str, handoff: KVHandoff,
                    prefill_ms: float) -> PrefillResponse:
        rid = record.request_id
        payload = tensor_payload(handoff.kv)
        # nbytes, checksum and transport are the sender's to fill
        header = TransferHeader(request_id=rid, token=token, model_identity=self.engine.engine.model_identity,
                                dtype=str(handoff.kv.dtype).removeprefix("torch."), shape=list(handoff.kv.shape),
                                nbytes=payload.nbytes, checksum="", transport="tcp", record=record)
        started = time.perf_counter()
        try:
            ack = await self.senders[body.transport].send(body.kv_target, header, payload)
        except TransferError as e:
            self.failed_transfers += 1
            log.warning("KV transfer of %s to %s failed: %s", rid, body.kv_target, e)
            return PrefillResponse(request_id=rid, ok=False, code="transfer_failed", message=str(e),
                                   prefill_ms=prefill_ms)
        transfer_ms = (time.perf_counter() - started) * 1e3
        if ack.ok:
            self.transfers_ok += 1
            self.transferred_bytes += payload.nbytes
        else:
            self.failed_transfers += 1
        return PrefillResponse(request_id=rid, ok=ack.ok, code=ack.code, message=ack.message, record=record,
                               prefill_ms=prefill_ms, transfer_ms=transfer_ms, nbytes=payload.nbytes)
