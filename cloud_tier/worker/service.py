"""The worker's serving logic: OpenAI request -> engine request, engine outputs -> the shared
generation events both tiers' servers format; and, for the gateway, the internal generate
call that runs a request here, prefilled locally or by a prefill worker."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cascade import errors
from cascade.generation import Finish, TokenEvent, TopToken
from cascade.protocol import ChatCompletionRequest, CompletionRequest
from cloud_tier import tokenizer_files
from cloud_tier.disagg.decode import DecodeService
from cloud_tier.disagg.prefill import PrefillService
from cloud_tier.disagg.protocol import GenerateRequest, ServedModel
from cloud_tier.disagg.records import params_of
from cloud_tier.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from cloud_tier.engine.outputs import RequestOutput
from cloud_tier.engine.request import Request
from cloud_tier.request_builder import Plan, RequestBuilder
from cloud_tier.worker.metrics import WorkerMetrics
from cloud_tier.worker.protocol import DecodeStats, EngineStats, PrefillStats, WorkerStats


@dataclass
class EngineJob:
    request: Request
    logprobs: int | None
    arrived: float


class WorkerService:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, aliases: set[str], metrics: WorkerMetrics,
                 role: str = "both", default_max_tokens: int = 512, prefill: PrefillService | None = None,
                 decode: DecodeService | None = None):
        self.engine = engine
        self.model_id = model_name
        self.model_names = {model_name, *aliases}
        self.metrics = metrics
        self.role = role
        self.max_model_len = engine.engine.max_model_len
        self.builder = RequestBuilder(engine.tokenizer, self.max_model_len, default_max_tokens)
        self.prefill = prefill
        self.decode = decode
        self._served: ServedModel | None = None

    def served_model(self) -> ServedModel:
        """The model's names and tokenizer for a gateway (dumped once, on first ask)."""
        if self._served is None:
            self._served = ServedModel(model=self.model_id, aliases=sorted(self.model_names - {self.model_id}),
                                       max_model_len=self.max_model_len,
                                       model_identity=self.engine.engine.model_identity,
                                       tokenizer_files=tokenizer_files.dump(self.engine.tokenizer))
        return self._served

    async def stats(self) -> WorkerStats:
        """What this worker holds now, the engine's part read between two steps (EngineDeadError
        if the engine stopped)."""
        engine = await self.engine.call(_engine_stats)
        p, d = self.prefill, self.decode
        return WorkerStats(
            role=self.role, engine=engine,
            prefill=None if p is None else PrefillStats(in_flight=p.in_flight, transfers_ok=p.transfers_ok,
                                                        transfers_failed=p.failed_transfers, cancelled=p.cancelled),
            decode=None if d is None else DecodeStats(
                pending=d.pending, adopted=d.adopted, rejected=d.rejected, cancelled=d.cancelled,
                transfers_expected=d.receiver.num_expected, transfers_receiving=d.receiver.num_receiving,
                receiving_bytes=d.receiver.inflight_bytes))

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise errors.model_not_found(model)

    # -- OpenAI request -> job -----------------------------------------------------------

    def chat_job(self, req: ChatCompletionRequest) -> EngineJob:
        self.check_model(req.model)
        return self._job(self.builder.chat(req))

    def completion_job(self, req: CompletionRequest) -> EngineJob:
        self.check_model(req.model)
        return self._job(self.builder.completion(req))

    def _job(self, plan: Plan) -> EngineJob:
        try:
            request = self.engine.prepare(plan.prompt_token_ids, plan.params, priority=plan.priority)
        except EngineDeadError as e:
            raise errors.APIError(503, str(e), "server_error", code="engine_unavailable") from e
        except (ValueError, TypeError) as e:
            raise errors.bad_request(str(e)) from e
        return EngineJob(request, plan.logprobs, time.perf_counter())

    # -- running ---------------------------------------------------------------------------

    async def run(self, job: EngineJob) -> AsyncIterator[TokenEvent | Finish]:
        """The engine's outputs for ``job`` as generation events (aborted if not read to the end)."""
        async for ev in self.events(self.engine.stream(job.request), job.arrived):
            yield ev

    async def generate(self, body: GenerateRequest) -> AsyncIterator[TokenEvent | Finish]:
        """The internal call: run ``body.record`` here, prefilled here or by ``body.prefill_url``."""
        arrived = time.perf_counter()
        rec = body.record
        if body.prefill_url is None:
            try:
                req = self.engine.prepare(rec.prompt_token_ids, params_of(rec), rec.request_id, rec.priority)
            except EngineDeadError as e:
                raise errors.APIError(503, str(e), "server_error", code="engine_unavailable") from e
            except (ValueError, TypeError) as e:
                raise errors.bad_request(str(e)) from e
            outputs = self.engine.stream(req)
        else:
            if self.decode is None:
                raise errors.bad_request(f"this worker's role is {self.role}: it does not adopt prefilled "
                                         "requests", "prefill_url")
            outputs = self.decode.generate_remote(body)
        async for ev in self.events(outputs, arrived):
            yield ev

    async def events(self, outputs: AsyncIterator[RequestOutput], arrived: float
                     ) -> AsyncIterator[TokenEvent | Finish]:
        decode = self.engine.tokenizer.decode
        m = self.metrics
        last = None
        try:
            async for out in outputs:
                now = time.perf_counter()
                for i, token in enumerate(out.new_token_ids):
                    lp = out.new_logprobs[i] if i < len(out.new_logprobs) else None
                    piece = decode([token]).encode()
                    top = tuple(_top_token(decode, t, v) for t, v in lp.top) if lp else ()
                    m.generation_tokens.inc()
                    if last is None:
                        m.ttft.observe(now - arrived)
                    else:
                        m.itl.observe(now - last)
                    last = now
                    yield TokenEvent(token, out.delta_text if i == len(out.new_token_ids) - 1 else "", piece,
                                     lp.logprob if lp else 0.0, 0.0, top)
                if out.finished:
                    m.prompt_tokens.inc(out.num_prompt_tokens)
                    m.e2e.observe(now - arrived)
                    yield Finish(out.finish_reason or "stop", out.num_prompt_tokens, len(out.token_ids),
                                 out.num_cached_tokens)
                    return
        except RequestFailedError as e:  # this request only (non-finite logits, ...): the engine goes on
            raise errors.APIError(500, f"The engine could not go on with this request: {e}", "server_error",
                                  code="engine_error") from e
        finally:
            await outputs.aclose()


def _engine_stats(engine) -> EngineStats:  # on the engine thread
    st = engine.stats()
    return EngineStats(running=st["running"], waiting=st["waiting"], held=len(engine.scheduler.held),
                       kv_blocks_free=st["kv_blocks_free"], kv_blocks_total=st["kv_blocks_total"])


def _top_token(decode, token_id: int, logprob: float) -> TopToken:
    text = decode([token_id])
    return TopToken(token_id, text, logprob, text.encode())
