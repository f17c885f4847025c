"""The decode side: ask a prefill worker to run the prompt and send the KV here, adopt the
request at ``num_computed_tokens == prompt length`` into this engine's continuous batch, and
stream its outputs. The KV receiver takes only the transfers asked for here (each request's
own token, a cap from its prompt's blocks) and validates each before anything is adopted."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from cloud_tier.disagg.messages import RequestRecord, TransferAck, TransferHeader
from cloud_tier.disagg.protocol import GenerateRequest, PrefillRequest, PrefillResponse
from cloud_tier.disagg.records import logprobs_of, params_of, service_level_of
from cloud_tier.disagg.transport import KVReceiver, ReceiverLimits, payload_to_tensor
from cloud_tier.draft import Draft
from cloud_tier.engine.async_engine import AsyncLLMEngine
from cloud_tier.engine.llm_engine import KVCapacityError
from cloud_tier.engine.model_runner import ModelRunner
from cloud_tier.engine.outputs import RequestOutput

log = logging.getLogger(__name__)


class PrefillFailed(RuntimeError):
    """The prefill worker could not run the prompt or deliver its KV here."""

    def __init__(self, code: str, message: str):
        super().__init__(f"prefill failed ({code}): {message}")
        self.code = code


@dataclass
class _Waiting:
    """A request whose prompt a prefill worker runs for this worker."""

    record: RequestRecord  # as asked for: the transfer must be of this prompt
    adopted: asyncio.Future  # (its first output, its stream) once its KV is in this engine
    draft_kept: int = 0  # of its draft (cascade.draft), the tokens the prefill worker's first token confirmed


class DecodeService:
    def __init__(self, engine: AsyncLLMEngine, client: httpx.AsyncClient, api_key: str = ""):
        self.engine = engine
        self.client = client
        self.api_key = api_key
        e = engine.engine
        self._block_bytes = ModelRunner.bytes_per_block(e.model, e.config.block_size, e.dtype, e.config.kv_cache_dtype)
        cache_bytes = e.kv.num_blocks * self._block_bytes  # more could never be adopted at once
        self.receiver = KVReceiver(self.on_transfer, model_identity=e.model_identity,
                                   limits=ReceiverLimits(max_nbytes=cache_bytes, max_inflight_bytes=cache_bytes))
        self._pending: dict[str, _Waiting] = {}
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
        PrefillFailed before the first output if that did not work (nothing was adopted).

        Closing or cancelling it at any point ends the request everywhere: the prefill call is
        closed (so the prefill worker aborts it), its KV transfer is refused or dropped, and
        what this engine adopted is aborted."""
        rec = body.record
        rid = rec.request_id
        if rid in self._pending:
            raise PrefillFailed("bad_request", f"request {rid!r} is already in flight")
        token = secrets.token_urlsafe(32)  # only the prefill worker we ask learns it
        waiting = self._pending[rid] = _Waiting(rec, asyncio.get_running_loop().create_future())
        stream = None
        finished = started = False
        try:
            # at most what this prompt's blocks hold: nothing larger is taken in
            self.receiver.expect(rid, token, self._block_bytes * self.engine.engine.kv.blocks_for_tokens(
                len(rec.prompt_token_ids)))
            resp = await self._call_prefill(body, token)
            if not resp.ok:
                raise PrefillFailed(resp.code or "error", resp.message)
            if resp.record is not None and resp.record.finish_reason is not None:
                finished = started = True
                yield _ended_on_prefill(resp)
                return
            if not waiting.adopted.done():  # the ack reached the prefill worker, so the handler has run
                raise PrefillFailed("error", "the prefill worker reported a transfer this worker did not adopt")
            first, stream = waiting.adopted.result()
            finished, started = first.finished, True
            yield _draft_told(first, rec, waiting.draft_kept)
            async for out in stream:
                finished = out.finished
                yield _draft_told(out, rec, waiting.draft_kept)
        except asyncio.CancelledError:
            if not started:
                self.cancelled += 1
            raise
        finally:
            self.receiver.forget(rid)  # a transfer still to come is refused, one under way dropped
            self._pending.pop(rid, None)
            if not waiting.adopted.done():
                waiting.adopted.cancel()
            elif stream is None and not waiting.adopted.cancelled():
                stream = waiting.adopted.result()[1]  # adopted, its caller gone before it was read
            if stream is not None:
                await stream.aclose()  # aborts it if unfinished
                if not finished:
                    self.engine.abort(rid)
            # no stream: nothing was adopted here, so nothing of ours runs under ``rid`` (an adopt
            # refused as a duplicate must not abort the other request holding that id)

    async def _call_prefill(self, body: GenerateRequest, token: str) -> PrefillResponse:
        # the draft is verified here, in the first decode step (the handoff carries one token)
        req = PrefillRequest(record=body.record.model_copy(update={"transfer_token": token, "draft_token_ids": [],
                                                                   "draft_probs": None, "draft_top": None}),
                             kv_target=self.address, transport=body.transport)
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
        """The receiver's handler: adopt a complete, verified transfer we asked for (the receiver
        admitted only those), continuing the request as this worker received it."""
        rid = header.request_id
        waiting = self._pending.get(rid)
        if waiting is None or waiting.adopted.done():
            self.rejected += 1
            return TransferAck(request_id=rid, ok=False, code="unknown_request",
                               message="no request is waiting for this KV here")
        rec, sent = waiting.record, header.record
        try:
            if sent.prompt_token_ids != rec.prompt_token_ids:
                raise ValueError("the KV is of another prompt than the one asked for")
            if len(sent.output_token_ids) != 1:
                raise ValueError("a transferred request carries exactly its first token")
            rest = _draft_after(rec.draft(), sent.output_token_ids[0])
            req = self.engine.prepare(rec.prompt_token_ids, params_of(rec), rid, rec.priority, service_level_of(rec),
                                      draft=rest)
            req.append_token(sent.output_token_ids[0])
            waiting.draft_kept = int(rec.draft_token_ids[:1] == sent.output_token_ids)  # its first token confirmed
            kv = payload_to_tensor(header, payload)
            stream = await self.engine.adopt(req, kv, logprobs_of(sent.logprobs[0]) if sent.logprobs else None,
                                             sent.sampler_state, sent.num_cached_tokens)
        except KVCapacityError as e:
            self.rejected += 1
            return TransferAck(request_id=rid, ok=False, code="no_capacity", message=str(e))
        except (ValueError, TypeError) as e:
            self.rejected += 1
            return TransferAck(request_id=rid, ok=False, code="bad_header", message=str(e))
        # The adoption delivered the first output: taking it starts the stream, so that closing
        # the stream (whoever does) aborts the request and forgets it.
        first = await anext(stream)
        if waiting.adopted.done():  # its caller went away while we adopted it
            await stream.aclose()
            self.rejected += 1
            return TransferAck(request_id=rid, ok=False, code="unknown_request", message="the caller went away")
        waiting.adopted.set_result((first, stream))
        self.adopted += 1
        return TransferAck(request_id=rid, ok=True)


def _ended_on_prefill(resp: PrefillResponse) -> RequestOutput:
    rec = resp.record
    lps = [logprobs_of(x) for x in rec.logprobs]
    return RequestOutput(rec.request_id, list(rec.prompt_token_ids), token_ids=list(rec.output_token_ids),
                         text=resp.text, new_token_ids=list(rec.output_token_ids), delta_text=resp.text,
                         logprobs=lps if rec.sampling.get("logprobs") is not None else None, new_logprobs=lps,
                         finished=True, finish_reason=rec.finish_reason, num_cached_tokens=rec.num_cached_tokens)


def _draft_after(draft: Draft | None, first: int) -> Draft | None:
    """What is left of a device's draft to verify after the prefill worker's first token: the rest
    of it when that token is its first (the same prefix, so speculative verification of the rest
    stays exact), else nothing (the draft went another way at once)."""
    if draft is None or len(draft.token_ids) < 2 or draft.token_ids[0] != first:
        return None
    return Draft(draft.token_ids[1:], draft.probs[1:] if draft.probs is not None else None,
                 draft.top[1:] if draft.top is not None else None)


def _draft_told(out: RequestOutput, rec: RequestRecord, kept: int) -> RequestOutput:
    """The output with its draft's counts as the device offered it: the whole draft, and accepted
    the token the prefill side confirmed plus what this engine accepted of the rest."""
    if not rec.draft_token_ids or not out.finished:
        return out
    return dataclasses.replace(out, draft_offered=len(rec.draft_token_ids),
                               draft_accepted=kept + out.draft_accepted if kept else 0)
