"""The worker's serving logic: OpenAI request -> engine request, engine outputs -> the shared
generation events both tiers' servers format; and, for the gateway, the internal generate
call that runs a request here, prefilled locally or by a prefill worker."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from cascade import errors
from cascade.generation import Finish, TokenEvent, TopToken
from cascade.protocol import ChatCompletionRequest, CompletionRequest
from cascade.structured.matcher import GrammarRefused
from cloud_tier import tokenizer_files
from cloud_tier.disagg.decode import DecodeService
from cloud_tier.disagg.prefill import PrefillService
from cloud_tier.disagg.protocol import GenerateRequest, ServedModel
from cloud_tier.disagg.records import arrival_of, params_of, service_level_of
from cloud_tier.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from cloud_tier.engine.outputs import RequestOutput
from cloud_tier.engine.request import Request, ServiceLevel
from cloud_tier.engine.scheduling.admission import SLOMissError
from cloud_tier.request_builder import RequestBuilder, RequestPlan, with_headers
from cloud_tier.worker.embeddings import WorkerEmbeddings
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
        # a device's draft is used only when its tokenizer identity is this model's (read from the GGUF once)
        self._tokenizer_identity = engine.engine.tokenizer_identity()
        self.builder = RequestBuilder(engine.tokenizer, self.max_model_len, default_max_tokens,
                                      tokenizer_identity=self._tokenizer_identity,
                                      model_vocab_size=engine.engine.model.config["vocab_size"])
        self.prefill = prefill
        self.decode = decode
        self._served: ServedModel | None = None
        self.embeddings = WorkerEmbeddings(engine, model_name)

    def tokenizer_identity(self) -> str:
        """This model's tokenizer identity (``model_distribution.artifacts.tokenizer_identity``):
        a draft is used only when it names the same."""
        return self._tokenizer_identity

    def served_model(self) -> ServedModel:
        """The model's names and tokenizer for a gateway (dumped once, on first ask)."""
        if self._served is None:
            self._served = ServedModel(model=self.model_id, aliases=sorted(self.model_names - {self.model_id}),
                                       max_model_len=self.max_model_len,
                                       model_identity=self.engine.engine.model_identity,
                                       tokenizer_identity=self._tokenizer_identity,
                                       embedding_identity=self.embeddings.identity(),
                                       vocab_size=self.builder.draft_vocab,
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

    def chat_job(self, req: ChatCompletionRequest, headers: Mapping[str, str] | None = None) -> EngineJob:
        self.check_model(req.model)
        return self._job(self.builder.chat(req), headers or {}, req)

    def completion_job(self, req: CompletionRequest, headers: Mapping[str, str] | None = None) -> EngineJob:
        self.check_model(req.model)
        return self._job(self.builder.completion(req), headers or {}, req)

    def _job(self, plan: RequestPlan, headers: Mapping[str, str], req) -> EngineJob:
        """``plan.draft``: the body's draft when its tokenizer is this model's (``RequestBuilder``)."""
        slo = service_level(plan, headers)
        self._count_offer(req, plan)
        try:
            request = self.engine.prepare(plan.prompt_token_ids, plan.params, priority=plan.priority, slo=slo,
                                          draft=plan.draft)
        except EngineDeadError as e:
            raise errors.APIError(503, str(e), "server_error", code="engine_unavailable") from e
        except GrammarRefused as e:
            raise grammar_refused(e) from e
        except (ValueError, TypeError) as e:
            raise errors.bad_request(str(e), getattr(e, "param", None)) from e
        if plan.params.guided is not None:
            self.metrics.guided.inc()
        return EngineJob(request, plan.logprobs, time.perf_counter())

    def _count_offer(self, req, plan: RequestPlan) -> None:
        if req.cascade is not None and req.cascade.draft is not None:
            self.metrics.drafts.labels(outcome="received" if plan.draft else "tokenizer_mismatch").inc()

    # -- running ---------------------------------------------------------------------------

    async def run(self, job: EngineJob) -> AsyncIterator[TokenEvent | Finish]:
        """The engine's outputs for ``job`` as generation events (aborted if not read to the end)."""
        async for ev in self.events(self.engine.stream(job.request), job.arrived, job.request.slo):
            yield ev

    async def generate(self, body: GenerateRequest) -> AsyncIterator[TokenEvent | Finish]:
        """The internal call: run ``body.record`` here, prefilled here or by ``body.prefill_url``."""
        arrived = time.perf_counter()
        rec = body.record
        if rec.draft_token_ids:  # the gateway took it: its tokenizer is this model's
            self.metrics.drafts.labels(outcome="received").inc()
        if body.prefill_url is None:
            try:
                req = self.engine.prepare(rec.prompt_token_ids, params_of(rec), rec.request_id, rec.priority,
                                          service_level_of(rec), arrival_of(rec), draft=rec.draft())
            except EngineDeadError as e:
                raise errors.APIError(503, str(e), "server_error", code="engine_unavailable") from e
            except GrammarRefused as e:
                raise grammar_refused(e) from e
            except (ValueError, TypeError) as e:
                raise errors.bad_request(str(e)) from e
            outputs = self.engine.stream(req)
        else:
            if self.decode is None:
                raise errors.bad_request(f"this worker's role is {self.role}: it does not adopt prefilled "
                                         "requests", "prefill_url")
            self._check_grammar(rec.sampling.get("guided"))
            outputs = self.decode.generate_remote(body)
        if rec.sampling.get("guided") is not None:
            self.metrics.guided.inc()
        async for ev in self.events(outputs, arrived, service_level_of(rec)):
            yield ev

    def _check_grammar(self, grammar) -> None:
        """A guided request's grammar compiled here (cached for its adoption): a 400 before a prefill
        worker is asked, not an error after its prefill."""
        if isinstance(grammar, str):
            try:
                self.engine.engine.guides.matcher(grammar)
            except GrammarRefused as e:
                raise grammar_refused(e) from e

    async def events(self, outputs: AsyncIterator[RequestOutput], arrived: float, slo: ServiceLevel
                     ) -> AsyncIterator[TokenEvent | Finish]:
        decode = self.engine.tokenizer.decode
        m = self.metrics
        last = first = None
        tenant = slo.tenant or "-"
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
                        first = now
                    else:
                        m.itl.observe(now - last)
                    last = now
                    yield TokenEvent(token, out.delta_text if i == len(out.new_token_ids) - 1 else "", piece,
                                     lp.logprob if lp else 0.0, 0.0, top)
                if out.finished:
                    if out.draft_offered:
                        self.metrics.observe_draft(out)
                    m.prompt_tokens.inc(out.num_prompt_tokens)
                    m.e2e.observe(now - arrived)
                    self._count_goodput(slo, tenant, arrived, first, now, len(out.token_ids))
                    yield Finish(out.finish_reason or "stop", out.num_prompt_tokens, len(out.token_ids),
                                 out.num_cached_tokens, truncated=out.truncated, draft_offered=out.draft_offered,
                                 draft_accepted=out.draft_accepted)
                    return
        except SLOMissError as e:  # refused before its first token: it would miss its TTFT target
            m.slo_rejected.labels(tenant=tenant, priority_class=slo.priority_class).inc()
            raise errors.too_many_requests(str(e), e.retry_after_s, "slo") from e
        except RequestFailedError as e:  # this request only (non-finite logits, ...): the engine goes on
            raise errors.APIError(500, f"The engine could not go on with this request: {e}", "server_error",
                                  code="engine_error") from e
        finally:
            await outputs.aclose()


    def _count_goodput(self, slo: ServiceLevel, tenant: str, arrived: float, first: float | None, last: float,
                       tokens: int) -> None:
        """A finished request counts for goodput when it met both its targets (the engine's
        defaults where it named none; no target: met)."""
        config = self.engine.engine.config
        ttft_target = slo.ttft_s or config.ttft_slo_s
        tpot_target = slo.tpot_s or config.tpot_slo_s
        ttft = (first or last) - arrived
        tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else 0.0
        met = (ttft_target is None or ttft <= ttft_target) and (tpot_target is None or tpot <= tpot_target)
        labels = {"tenant": tenant, "priority_class": slo.priority_class}
        self.metrics.finished.labels(**labels).inc()
        if met:
            self.metrics.goodput.labels(**labels).inc()


def service_level(plan: RequestPlan, headers: Mapping[str, str], now: float | None = None) -> ServiceLevel:
    """A direct request's service level: the body's fields (``RequestPlan``) under the X-Cascade-* headers
    (``with_headers``: 400 on a bad one); its deadline from now (``time.monotonic()``)."""
    plan = with_headers(plan, headers)
    deadline = None if plan.timeout_s is None else (time.monotonic() if now is None else now) + plan.timeout_s
    return ServiceLevel(plan.priority_class, plan.ttft_slo_s, plan.tpot_slo_s, deadline)


def grammar_refused(e: GrammarRefused) -> errors.APIError:
    """The 400 of a guided request whose grammar cannot be compiled (within its bounds) here."""
    return errors.bad_request(f"the output's grammar cannot be enforced: {e}", "response_format", "invalid_schema")


def _engine_stats(engine) -> EngineStats:  # on the engine thread
    st = engine.stats()
    return EngineStats(running=st["running"], waiting=st["waiting"], held=len(engine.scheduler.held),
                       kv_blocks_free=st["kv_blocks_free"], kv_blocks_total=st["kv_blocks_total"])


def _top_token(decode, token_id: int, logprob: float) -> TopToken:
    text = decode([token_id])
    return TopToken(token_id, text, logprob, text.encode())
