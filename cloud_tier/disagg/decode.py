"""The decode side: ask a prefill worker to run the prompt and send the KV here, adopt the
request at ``num_computed_tokens == prompt length`` into this engine's continuous batch, and
stream its outputs. The KV receiver validates every transfer before anything is adopted."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import httpx

from cloud_tier.disagg.messages import TransferAck, TransferHeader
from cloud_tier.disagg.protocol import GenerateRequest, PrefillRequest, PrefillResponse
from cloud_tier.disagg.records import logprobs_of, params_of
from cloud_tier.disagg.transport import KVReceiver, payload_to_tensor
from cloud_tier.engine.async_engine import AsyncLLMEngine
from cloud_tier.engine.llm_engine import KVCapacityError
from cloud_tier.engine.outputs import RequestOutput

log = logging.getLogger(__name__)


class PrefillFailed(RuntimeError):
    """The prefill worker could not run the prompt or deliver its KV here."""

    def __init__(self, code: str, message: str):
        super().__init__(f"prefill failed ({code}): {message}")
        self.code = code


class DecodeService:
    def __init__(self, engine: AsyncLLMEngine, client: httpx.AsyncClient, api_key: str = ""):
        self.engine = engine
        self.client = client
        self.api_key = api_key
        self.receiver = KVReceiver(self.on_transfer, model_identity=engine.engine.model_identity)
        self._pending: dict[str, asyncio.Future] = {}
        self.adopted = 0
        self.rejected = 0
        self.cancelled = 0

    async def start(self, host: str, port: int = 0) -> None:
        await self.receiver.start(host, port)

    async def close(self) -> None:
        await self.receiver.close()

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def address(self) -> str:
        return self.receiver.address

    async def generate_remote(self, body: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs, its prompt prefilled by ``body.prefill_url``. Raises
        PrefillFailed before the first output if that did not work (nothing was adopted)."""
        rec = body.record
        rid = rec.request_id
        if rid in self._pending:
            raise PrefillFailed("bad_request", f"request {rid!r} is already in flight")
        adopted = self._pending[rid] = asyncio.get_running_loop().create_future()
        finished = False
        try:
            resp = await self._call_prefill(body)
            if not resp.ok:
                raise PrefillFailed(resp.code or "error", resp.message)
            if resp.record is not None and resp.record.finish_reason is not None:
                finished = True
                yield _ended_on_prefill(resp)
                return
            if not adopted.done():  # the ack reached the prefill worker, so the handler has run
                raise PrefillFailed("error", "the prefill worker reported a transfer this worker did not adopt")
            async for out in adopted.result():
                finished = out.finished
                yield out
        finally:
            self._pending.pop(rid, None)
            if not adopted.done():
                adopted.cancel()
            if not finished:
                self.engine.abort(rid)

    async def _call_prefill(self, body: GenerateRequest) -> PrefillResponse:
        req = PrefillRequest(record=body.record, kv_target=self.address, transport=body.transport)
        headers = {"content-type": "application/json"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        try:
            r = await self.client.post(f"{body.prefill_url.rstrip('/')}/internal/prefill",
                                       content=req.model_dump_json(), headers=headers)
        except httpx.HTTPError as e:
            raise PrefillFailed("prefill_unreachable", f"{body.prefill_url}: {e!r}") from e
        if r.status_code != 200:
            raise PrefillFailed("prefill_error", f"{body.prefill_url} answered {r.status_code}: {r.text[:300]}")
        return PrefillResponse.model_validate_json(r.content)

    async def on_transfer(self, header: TransferHeader, payload: memoryview) -> TransferAck:
        """The receiver's handler: adopt a complete, verified transfer we asked for."""
        rec = header.record
        rid = rec.request_id
        waiting = self._pending.get(rid)
        if waiting is None or waiting.done():
            self.rejected += 1
            return TransferAck(request_id=rid, ok=False, code="unknown_request",
                               message="no request is waiting for this KV here")
        try:
            req = self.engine.prepare(rec.prompt_token_ids, params_of(rec), rid, rec.priority)
            if len(rec.output_token_ids) != 1:
                raise ValueError("a transferred request carries exactly its first token")
            req.append_token(rec.output_token_ids[0])
            kv = payload_to_tensor(header, payload)
            stream = await self.engine.adopt(req, kv, logprobs_of(rec.logprobs[0]) if rec.logprobs else None,
                                             rec.sampler_state, rec.num_cached_tokens)
        except KVCapacityError as e:
            self.rejected += 1
            return TransferAck(request_id=rid, ok=False, code="no_capacity", message=str(e))
        except (ValueError, TypeError) as e:
            self.rejected += 1
            return TransferAck(request_id=rid, ok=False, code="bad_header", message=str(e))
        if waiting.done():  # its caller went away while we adopted it
            self.engine.abort(rid)
            return TransferAck(request_id=rid, ok=False, code="unknown_request", message="the caller went away")
        waiting.set_result(stream)
        self.adopted += 1
        return TransferAck(request_id=rid, ok=True)


def _ended_on_prefill(resp: PrefillResponse) -> RequestOutput:
    rec = resp.record
    lps = [logprobs_of(x) for x in rec.logprobs]
    return RequestOutput(rec.request_id, list(rec.prompt_token_ids), token_ids=list(rec.output_token_ids),
                         text=resp.text, new_token_ids=list(rec.output_token_ids), delta_text=resp.text,
                         logprobs=lps if rec.sampling.get("logprobs") is not None else None, new_logprobs=lps,
                         finished=True, finish_reason=rec.finish_reason, num_cached_tokens=rec.num_cached_tokens)
