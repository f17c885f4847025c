"""The worker's serving logic: OpenAI request -> engine request, engine outputs -> the shared
generation events both tiers' servers format."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cascade import errors
from cascade.chat_template import ChatTemplate, ChatTemplateError
from cascade.generation import Finish, TokenEvent, TopToken
from cascade.protocol import ChatCompletionRequest, CompletionRequest
from cloud_tier.engine.async_engine import AsyncLLMEngine, EngineDeadError
from cloud_tier.engine.request import Request
from cloud_tier.engine.sampling_params import SamplingParams
from cloud_tier.worker.metrics import WorkerMetrics


@dataclass
class Job:
    request: Request
    logprobs: int | None
    arrived: float


class WorkerService:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, aliases: set[str], metrics: WorkerMetrics,
                 default_max_tokens: int = 512):
        self.engine = engine
        self.model_id = model_name
        self.model_names = {model_name, *aliases}
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        tok = engine.tokenizer
        self.template = ChatTemplate(getattr(tok, "chat_template", None), tok.bos_token or "", tok.eos_token or "")
        self._bos = tok.bos_token_id
        self._adds_bos = self._bos is not None and tok.encode("a")[:1] == [self._bos]
        self.max_model_len = engine.engine.max_model_len

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise errors.model_not_found(model)

    # -- request -> job --------------------------------------------------------------------

    def chat_job(self, req: ChatCompletionRequest) -> Job:
        self.check_model(req.model)
        try:
            prompt = self.template.render([{"role": m.role, "content": m.text()} for m in req.messages])
        except ChatTemplateError as e:
            raise errors.bad_request(str(e), "messages") from e
        tokens = self.engine.tokenizer.encode(prompt, add_special_tokens=False)
        if self._adds_bos and (not tokens or tokens[0] != self._bos):
            tokens.insert(0, self._bos)
        stops = tuple(req.stop_list()) + self.template.stop_strings()
        k = (req.top_logprobs or 0) if req.logprobs else None
        return self._job(req, tokens, req.token_limit(), stops, k, "messages")

    def completion_job(self, req: CompletionRequest) -> Job:
        self.check_model(req.model)
        tokens = self.engine.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        return self._job(req, tokens, req.token_limit(), tuple(req.stop_list()), req.logprobs, "prompt")

    def _job(self, req, tokens: list[int], max_tokens: int | None, stops: tuple[str, ...],
             logprobs: int | None, prompt_param: str) -> Job:
        n_ctx = self.max_model_len
        if len(tokens) >= n_ctx:
            raise errors.bad_request(
                f"This model's maximum context length is {n_ctx} tokens. However, your {prompt_param} "
                f"resulted in {len(tokens)} tokens.", prompt_param, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, n_ctx - len(tokens))
        elif len(tokens) + max_tokens > n_ctx:
            raise errors.bad_request(
                f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                f"{len(tokens) + max_tokens} tokens ({len(tokens)} in the {prompt_param}, {max_tokens} in "
                f"the completion).", "max_tokens", "context_length_exceeded")
        extra = req.model_extra or {}
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, min_p=req.min_p or 0.0,
                seed=req.seed, stop=stops, logprobs=logprobs,
                repetition_penalty=req.repetition_penalty or 1.0,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                ignore_eos=bool(extra.get("ignore_eos", False)),
                stop_token_ids=tuple(extra.get("stop_token_ids") or ()))
            request = self.engine.prepare(tokens, params, priority=int(extra.get("priority", 0)))
        except EngineDeadError as e:
            raise errors.APIError(503, str(e), "server_error", code="engine_unavailable") from e
        except (ValueError, TypeError) as e:
            raise errors.bad_request(str(e)) from e
        return Job(request, logprobs, time.perf_counter())

    # -- running ---------------------------------------------------------------------------

    async def run(self, job: Job) -> AsyncIterator[TokenEvent | Finish]:
        """The engine's outputs for ``job`` as generation events (aborted if not read to the end)."""
        decode = self.engine.tokenizer.decode
        m = self.metrics
        last = None
        async for out in self.engine.stream(job.request):
            now = time.perf_counter()
            for i, token in enumerate(out.new_token_ids):
                lp = out.new_logprobs[i] if i < len(out.new_logprobs) else None
                piece = decode([token]).encode()
                top = tuple(_top_token(decode, t, v) for t, v in lp.top) if lp else ()
                m.generation_tokens.inc()
                if last is None:
                    m.ttft.observe(now - job.arrived)
                else:
                    m.itl.observe(now - last)
                last = now
                yield TokenEvent(token, out.delta_text if i == len(out.new_token_ids) - 1 else "", piece,
                                 lp.logprob if lp else 0.0, 0.0, top)
            if out.finished:
                m.prompt_tokens.inc(out.num_prompt_tokens)
                m.e2e.observe(now - job.arrived)
                yield Finish(out.finish_reason or "stop", out.num_prompt_tokens, len(out.token_ids),
                             out.num_cached_tokens)
                return


def _top_token(decode, token_id: int, logprob: float) -> TopToken:
    text = decode([token_id])
    return TopToken(token_id, text, logprob, text.encode())
